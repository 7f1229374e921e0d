"""Rollout batches over ZeroMQ (``orchestrator.batch_transport = "zmq"``): each trainer rank gets
its own micro-batches and only those, a missing producer or batch is reported, and a job on it
gives the same run as on files, with no rollout file written."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from primerl.runtime.validate import load_config
from primerl.runtime.launch.threads import run_threads
from primerl.runtime.transport import ProducerDied, TransportTimeout
from primerl.runtime.zmq_transport import ZmqTransport

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    """A free port, reserved until this process exits (no other process can take it first)."""
    from primerl.runtime.ports import held_port

    return held_port()


def test_each_rank_gets_its_own_batches(tmp_path):
    port = _free_port()
    server = ZmqTransport(tmp_path / "o", side="orchestrator", port=port)
    clients = [ZmqTransport(tmp_path / f"t{r}", side="trainer", port=port) for r in range(3)]
    g = torch.Generator().manual_seed(0)
    sent = {(s, r): {"x": torch.randn(5, r + 2, generator=g), "step": s, "rank": r} for s in range(3) for r in range(3)}
    got = {}

    def fetch(r):
        for s in range(3):
            got[(s, r)] = clients[r].get_batch(s, r, timeout=30)

    threads = [threading.Thread(target=fetch, args=(r,)) for r in range(3)]
    for t in threads:  # the ranks ask before the batches exist
        t.start()
    time.sleep(0.2)
    for key in sorted(sent, key=lambda k: (k[0], -k[1])):
        server.put_batch(*key, sent[key])
    for t in threads:
        t.join(30)
    assert sorted(got) == sorted(sent)
    for k, v in sent.items():
        assert got[k]["step"] == k[0] and got[k]["rank"] == k[1] and torch.equal(got[k]["x"], v["x"])
    assert server._ready == {} and server._waiting == {}  # each batch sent once, to its rank
    assert not any((tmp_path / "o" / "rollouts").iterdir())
    for c in (server, *clients):
        c.close()


def test_a_missing_batch_times_out_and_a_dead_producer_is_named(tmp_path):
    port = _free_port()  # no server
    client = ZmqTransport(tmp_path, side="trainer", port=port)
    with pytest.raises(TransportTimeout, match=rf"step 4 \(rank 1\) from the orchestrator at tcp://127.0.0.1:{port}"):
        client.get_batch(4, 1, timeout=0.5)
    with pytest.raises(ProducerDied, match="its producer is no longer running"):
        client.get_batch(4, 1, timeout=30, alive=lambda: False)
    client.close()


def _cfg(out, *over):
    return load_config(ROOT / "examples" / "reverse_text.toml",
                       ["--output_dir", str(out), "--max_steps", "3", "--orchestrator.batch_size", "4",
                        "--orchestrator.group_size", "4", "--orchestrator.max_async_level", "0", "--log.plot", "false",
                        "--log.progress", "false", *over])


def test_a_job_on_zmq_matches_the_job_on_files(tmp_path):
    files = run_threads(_cfg(tmp_path / "files"))
    zmq = run_threads(_cfg(tmp_path / "zmq", "--orchestrator.batch_transport", "zmq",
                           "--orchestrator.zmq_port", str(_free_port())))
    assert [r["step"] for r in zmq] == [0, 1, 2]
    for a, b in zip(zmq, files):
        # test_job._same_run's tolerance
        assert a["reward/mean"] == b["reward/mean"] and a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    assert not list((tmp_path / "zmq" / "transport" / "rollouts").iterdir())  # nothing went through the disk
