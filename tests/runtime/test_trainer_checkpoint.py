"""Trainer checkpoints: stale temp directories are removed at start and after a failed save; a
corrupt weights file is reported by name."""

import errno
import os
import subprocess
import sys

import pytest
import torch

from primerl.models.checkpoint import CheckpointError
from primerl.runtime.trainer import checkpoint as ckpt
from primerl.runtime.validate import load_config
from primerl.runtime.launch.common import prepare_output
from primerl.runtime.transport import STABLE, FileTransport


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _save(root, step):
    return ckpt.save_checkpoint(root, step, {"w": torch.full((3,), float(step))}, {"opt": step})


def test_stale_temp_dirs_go_and_a_live_writers_stays(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        dead = tmp_path / f".tmp_step_000002.{_dead_pid()}"
        mine = tmp_path / f".tmp_step_000003.{os.getpid()}"
        other = tmp_path / f".tmp_step_000004.{live.pid}"
        for d in (dead, mine, other):
            (d / "junk").mkdir(parents=True)
        removed = ckpt.remove_stale_tmp_dirs(tmp_path)
        assert sorted(removed) == sorted([dead, mine]) and other.is_dir() and not dead.exists()
    finally:
        live.kill()
        live.wait()


def test_failed_save_leaves_no_temp_dir_and_the_previous_checkpoint(tmp_path, monkeypatch):
    _save(tmp_path, 2)

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "atomic_torch_save", no_space)
    with pytest.raises(OSError, match="No space left"):
        _save(tmp_path, 4)
    assert not list(tmp_path.glob(".tmp_step_*"))
    step, path = ckpt.latest_checkpoint(tmp_path)
    assert step == 2 and ckpt.load_checkpoint(path)[1]["w"].tolist() == [2.0, 2.0, 2.0]


def test_job_start_removes_stale_temp_dirs_before_resuming(tmp_path):
    cfg = load_config(None, ["--output_dir", str(tmp_path), "--checkpoint.resume", "true"])
    _save(tmp_path / "checkpoints", 2)
    stale = [tmp_path / "checkpoints" / f".tmp_step_000004.{_dead_pid()}",
             tmp_path / "transport" / "weights" / f".tmp_step_000003.{_dead_pid()}"]
    for d in stale:
        d.mkdir(parents=True)
    assert prepare_output(cfg) == 2 and not any(d.exists() for d in stale)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])


def test_corrupt_weights_are_reported_with_the_file_name(tmp_path):
    final = _save(tmp_path, 2)
    _truncate(final / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{final / 'model.safetensors'}: not a readable safetensors file"):
        ckpt.load_checkpoint(final)
    tr = FileTransport(tmp_path / "transport")
    tr.publish_weights(1, {"w": torch.ones(4)})
    f = tr.weights_dir(1) / "model.safetensors"
    _truncate(f)
    with pytest.raises(CheckpointError, match=f"{f}: not a readable"):
        tr.load_weights(1)


def test_failed_weight_publish_leaves_no_temp_dir(tmp_path):
    tr = FileTransport(tmp_path)
    tr.publish_weights(0, {"w": torch.zeros(2)})

    def full_disk(path):
        path.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        tr.publish_weights(1, None, write=full_disk)
    assert not list(tr.weights.glob(".tmp_step_*")) and tr.weight_versions() == [0]


def test_a_republished_version_is_whole_whenever_a_reader_looks(tmp_path, monkeypatch):
    """A resumed trainer publishes its start version again while the orchestrator may be loading
    the old copy: after every file operation of the republish, the version's directory is either
    absent (a reader waits for it) or complete with its marker; a reader that looks in the gap
    gets the new weights, and nothing is left behind."""
    import threading

    tr = FileTransport(tmp_path)
    tr.publish_weights(2, {"w": torch.zeros(4096)})
    final = tr.weights_dir(2)
    seen, readers = [], []

    def check(*_):
        if final.exists():
            assert (final / STABLE).exists(), "the version's directory without its marker"
            w = tr.load_weights(2)["w"]  # the old or the new weights, whole
            seen.append(float(w[0]))
            assert bool((w == w[0]).all()) and w.numel() == 4096
        else:
            assert list(tr.weights.glob(".tmp_step_000002.replaced.*")), "the version vanished"
            t = threading.Thread(target=lambda: readers.append(tr.load_weights(2)["w"]))
            t.start()
            readers.append(t)

    for name in ("unlink", "rmdir", "replace"):
        real = getattr(os, name)

        def hooked(*a, _real=real, **k):
            out = _real(*a, **k)
            check()
            return out

        monkeypatch.setattr(os, name, hooked)
    tr.publish_weights(2, {"w": torch.ones(4096)})
    monkeypatch.undo()
    threads = [t for t in readers if isinstance(t, threading.Thread)]
    assert threads, "the republish never left the gap this test is about"
    for t in threads:
        t.join(timeout=60)
    got = [w for w in readers if not isinstance(w, threading.Thread)]
    assert len(got) == len(threads) and all(bool((w == 1).all()) for w in got)
    assert 0.0 in seen and 1.0 in seen
    assert not list(tr.weights.glob(".tmp_*")) and bool((tr.load_weights(2)["w"] == 1).all())


def test_a_republish_that_fails_between_its_renames_keeps_the_old_version(tmp_path, monkeypatch):
    tr = FileTransport(tmp_path)
    tr.publish_weights(2, {"w": torch.zeros(8)})
    real = os.replace

    def replace(src, dst):
        if str(src).endswith(f".tmp_step_000002.{os.getpid()}"):  # the new directory's rename into place
            raise OSError(errno.EIO, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="Input/output error"):
        tr.publish_weights(2, {"w": torch.ones(8)})
    monkeypatch.undo()
    assert tr.weight_versions() == [2] and bool((tr.load_weights(2)["w"] == 0).all())
    assert not list(tr.weights.glob(".tmp_*"))
