"""Atomic trainer checkpoints: ``<dir>/step_000012/{model.safetensors, state.pt, meta.json}``.

A checkpoint is written into a temporary directory and renamed into place only when every
file is complete and fsynced, so a crash mid-save leaves the previous checkpoint usable and
no half-written directory is ever picked by ``latest_checkpoint``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..transport import TMP_PREFIX, atomic_torch_save, atomic_write_bytes, remove_stale_tmp_dirs  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    import torch

    from ..config import RLConfig


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    out = []
    for d in root.glob("step_*"):
        if d.is_dir() and (d / "meta.json").exists():
            try:
                out.append((int(d.name[5:]), d))
            except ValueError:
                continue
    return sorted(out)


def latest_checkpoint(root: str | Path) -> tuple[int, Path] | None:
    dirs = _step_dirs(Path(root))
    return dirs[-1] if dirs else None


def start_step(cfg: RLConfig) -> int:
    """The step the job starts at: with ``checkpoint.resume``, that of the latest complete checkpoint
    in ``<output_dir>/checkpoints`` (0 without one); else 0. The launcher and the orchestrator read it."""
    if not cfg.checkpoint.resume:
        return 0
    found = latest_checkpoint(Path(cfg.output_dir) / "checkpoints")
    return found[0] if found else 0


def save_checkpoint(root: str | Path, step: int, model_state: dict[str, torch.Tensor], train_state: dict[str, Any],
                    *, keep: int = 2, meta: dict | None = None) -> Path:
    """Save after ``step`` optimizer steps. ``train_state``: optimizer, scheduler, RNG, counters."""
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"{TMP_PREFIX}{step:06d}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_file({k: v.detach().cpu().contiguous() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
        with open(tmp / "model.safetensors", "rb+") as f:
            os.fsync(f.fileno())
        atomic_torch_save(train_state, tmp / "state.pt")
        atomic_write_bytes(tmp / "meta.json", json.dumps({"step": step, **(meta or {})}).encode())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        remove_stale_tmp_dirs(root)
        raise
    for _, old in _step_dirs(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
    from primerl.models.checkpoint import read_safetensors

    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json)")
    meta = json.loads(meta_file.read_text())
    import torch

    train_state = torch.load(path / "state.pt", weights_only=False)
    return int(meta["step"]), read_safetensors(path / "model.safetensors"), train_state
