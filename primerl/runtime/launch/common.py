"""What every launcher (one machine, local nodes, a node by hand) does before it starts processes:
the resume step, the prepared ``output_dir`` and the error that names a failed process."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..config import RLConfig, to_toml
from ..trainer.checkpoint import remove_stale_tmp_dirs, start_step
from ..transport import FileTransport

__all__ = ["JobFailed", "prepare_output", "start_step"]


class JobFailed(RuntimeError):
    pass


def prepare_output(cfg: RLConfig) -> int:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for d in ("checkpoints", "transport/weights"):  # temp dirs of saves that failed or were killed
        remove_stale_tmp_dirs(out / d)
    step = start_step(cfg)
    if not cfg.checkpoint.resume:
        for name in ("transport", "checkpoints"):
            shutil.rmtree(out / name, ignore_errors=True)
        (out / "metrics.jsonl").unlink(missing_ok=True)
    transport = FileTransport(out / "transport")
    transport.drop_batches_from(step)
    transport.drop_weights_after(step)
    (out / "config.toml").write_text(to_toml(cfg))
    (out / "logs").mkdir(exist_ok=True)
    return step
