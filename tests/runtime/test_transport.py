"""File transport and checkpoints: atomic hand-over, versions, timeouts, dead producers, crash-safe saves."""

import os
import threading

import pytest
import torch

from primerl.runtime.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from primerl.runtime.transport import FileTransport, ProducerDied, TransportTimeout, atomic_write_bytes


def test_batch_round_trip_and_no_partial_files(tmp_path):
    tr = FileTransport(tmp_path)
    payload = {"x": torch.arange(5), "m": {"reward/mean": 0.5}}
    tr.put_batch(3, 1, payload)
    got = tr.get_batch(3, 1, timeout=1)
    assert torch.equal(got["x"], payload["x"]) and got["m"] == payload["m"]
    leftovers = [p.name for p in tmp_path.rglob("*") if ".tmp" in p.name]
    assert leftovers == []


def test_get_batch_waits_for_a_late_producer(tmp_path):
    tr = FileTransport(tmp_path)
    threading.Timer(0.2, lambda: tr.put_batch(0, 0, {"v": 7})).start()
    assert tr.get_batch(0, 0, timeout=5)["v"] == 7


def test_timeouts_and_dead_producer(tmp_path):
    tr = FileTransport(tmp_path)
    with pytest.raises(TransportTimeout, match="step 4"):
        tr.get_batch(4, 0, timeout=0.2)
    with pytest.raises(ProducerDied, match="no longer running"):
        tr.get_batch(4, 0, timeout=30, alive=lambda: False)
    with pytest.raises(TransportTimeout, match="version >= 2"):
        tr.wait_weights(2, timeout=0.1)


def test_weights_versions_and_cleanup(tmp_path):
    tr = FileTransport(tmp_path)
    assert tr.latest_weights() is None
    for v in range(4):
        tr.publish_weights(v, {"w": torch.full((2, 3), float(v))})
    assert tr.weight_versions() == [0, 1, 2, 3]
    assert torch.equal(tr.load_weights(2)["w"], torch.full((2, 3), 2.0))
    # a directory without its marker (a crash mid-publish) is invisible
    (tr.weights / "step_000009").mkdir()
    assert tr.latest_weights() == 3 and tr.wait_weights(3, timeout=1) == 3
    tr.drop_weights_before(2)
    tr.drop_weights_after(2)
    assert tr.weight_versions() == [2]
    with pytest.raises(FileNotFoundError):
        tr.load_weights(0)


def test_atomic_write_replaces_whole_file(tmp_path):
    p = tmp_path / "a" / "f.bin"
    atomic_write_bytes(p, b"one")
    atomic_write_bytes(p, b"two-two")
    assert p.read_bytes() == b"two-two" and os.listdir(p.parent) == ["f.bin"]


def _model_and_opt(seed):
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return m, opt


def test_checkpoint_round_trip_keep_and_crash_mid_save(tmp_path, monkeypatch):
    m, opt = _model_and_opt(0)
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, m.state_dict(), {"optimizer": opt.state_dict(), "k": step}, keep=2)
    assert [d.name for d in sorted(tmp_path.glob("step_*"))] == ["step_000004", "step_000006"]
    step, sd, state = load_checkpoint(latest_checkpoint(tmp_path)[1])
    assert step == 6 and state["k"] == 6 and torch.equal(sd["weight"], m.weight)

    import primerl.runtime.trainer.checkpoint as ck

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "atomic_torch_save", boom)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 8, m.state_dict(), {"k": 8}, keep=2)
    assert latest_checkpoint(tmp_path)[0] == 6  # the previous checkpoint is intact and chosen
    assert load_checkpoint(latest_checkpoint(tmp_path)[1])[0] == 6
