"""A node agent's watch (``launch.node_watch.NodeWatch``) told SIGTERM at the job's normal end from
SIGTERM as a failure (issue 45): a serving node's agent ends its round with SIGTERM once trainer
node 0's agent posted ``primerl/done``; that round's process used to log ``primerl node: FAILED:
... got SIGTERM`` and post an abort although the job ended well.

The real signal path, in this process: ``os.kill(getpid(), SIGTERM)`` wakes the watch's thread
through ``signal.set_wakeup_fd``; the store (a ``TCPStore`` on port 0) is read on that thread."""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta

import pytest

from primerl.runtime.launch.node_supervise import DONE_KEY
from primerl.runtime.launch.node_watch import NodeWatch

WHERE = "node 1 (127.0.0.2) inference"


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield s
    del s


def _sigterm(store, *, done: bool, attach: bool = True, port: int | None = None):
    """SIGTERM to a watch (``done``: ``DONE_KEY`` posted first); the reason its ``on_end`` got, and the watch."""
    if done:
        store.set(DONE_KEY, "1")
    got, ended = [], threading.Event()
    watch = NodeWatch(WHERE, lambda reason: (got.append(reason), ended.set()), grace_s=5, interval_s=0.1,
                      done_key=DONE_KEY).start()
    try:
        if attach:
            watch.attach("127.0.0.1", port or store.port, "trainer node 0 (127.0.0.1)")
        os.kill(os.getpid(), signal.SIGTERM)
        assert ended.wait(30), "the watch did not end the node on SIGTERM"
    finally:
        watch.close()
    return got[0], watch


def test_sigterm_after_the_job_is_done_is_a_normal_end(store):
    reason, watch = _sigterm(store, done=True)
    assert watch.job_done and watch.exit_code() == 0
    code, line = watch.final(reason)
    assert code == 0 and "FAILED" not in line, line
    assert line == f"primerl node: {WHERE}: the job is done (trainer node 0 finished); ending this node", line
    assert not store.check([watch.abort_key])  # no abort posted: nobody is told of a failure


def test_sigterm_while_the_job_runs_is_still_a_failure(store):
    reason, watch = _sigterm(store, done=False)
    assert not watch.job_done and watch.exit_code() == 143
    code, line = watch.final(reason)
    assert code == 143 and line.startswith(f"primerl node: FAILED: {WHERE}: got SIGTERM; ending the job's processes")
    assert store.get(watch.abort_key).decode() == reason  # posted for the other nodes


def test_sigterm_before_joining_or_with_the_store_gone_is_a_failure(store):
    from primerl.runtime.ports import held_port

    for attach, port in ((False, None), (True, held_port())):  # not attached yet; a port nobody serves
        store.set(DONE_KEY, "1")  # even so: what cannot be read is no normal end
        reason, watch = _sigterm(store, done=False, attach=attach, port=port)
        assert watch.exit_code() == 143 and watch.final(reason)[1].startswith("primerl node: FAILED:"), reason
