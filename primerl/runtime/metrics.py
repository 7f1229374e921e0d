"""Per-step metrics: ``<output_dir>/metrics.jsonl`` (always), a progress line, a saved plot,
and optional TensorBoard / Weights & Biases sinks.

One JSON object per step with at least ``step``, ``reward/mean``, ``mismatch_kl/mean``,
``off_policy/max`` and ``tokens_per_s``. Every line is strict JSON: a NaN or infinite value is
written as ``null`` (Python's ``json`` would write the bare ``NaN``/``Infinity`` that jq and most
parsers reject), so a skipped update's ``grad_norm`` reads back as None.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable

REQUIRED = ("step", "reward/mean", "mismatch_kl/mean", "off_policy/max", "tokens_per_s")


def json_safe(v):
    """``v`` with every non-finite float (nested in dicts/lists too) replaced by None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line of a killed writer
                continue
    return out


class MetricsLogger:
    """Appends one line per step; ``start_step`` drops lines a crashed run wrote at or after it."""

    def __init__(self, output_dir: str | Path, *, start_step: int = 0, tensorboard: bool = False,
                 wandb: bool = False, wandb_project: str = "primerl", config: dict | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [m for m in read_metrics(self.path) if m.get("step", -1) < start_step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(json_safe(m), allow_nan=False) + "\n" for m in kept))
        os.replace(tmp, self.path)
        self._f = open(self.path, "a")
        self._tb = self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError("log.tensorboard = true needs the tensorboard package "
                                   "(pip install tensorboard)") from e
            self._tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))
        if wandb:
            try:
                import wandb as _wandb
            except ImportError as e:
                raise RuntimeError("log.wandb = true needs the wandb package (pip install wandb)") from e
            self._wandb = _wandb.init(project=wandb_project, config=config or {}, dir=str(output_dir))

    def log(self, metrics: dict) -> None:
        missing = [k for k in REQUIRED if k not in metrics]
        if missing:
            raise ValueError(f"metrics for a step must contain {REQUIRED}; missing {missing}")
        self._f.write(json.dumps(json_safe(metrics), allow_nan=False) + "\n")
        self._f.flush()
        step = int(metrics["step"])
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def progress_line(m: dict, max_steps: int | None = None) -> str:
    total = f"/{max_steps}" if max_steps else ""
    return (f"step {m['step']:>4}{total} | reward {_fmt(m.get('reward/mean'), '.3f')} "
            f"| mismatch_kl {_fmt(m.get('mismatch_kl/mean'), '.2e')} | off_policy {m.get('off_policy/max', '-')} "
            f"| {_fmt(m.get('tokens_per_s'), '.0f')} tok/s | {_fmt(m.get('time/step_s'), '.2f')} s/step "
            f"| loss {_fmt(m.get('loss'), '+.4f')}")


def save_plot(metrics: Iterable[dict], path: str | Path,
              keys: tuple[str, ...] = ("reward/mean", "mismatch_kl/mean", "tokens_per_s")) -> Path | None:
    """A figure with one panel per key against the step (and one of every ``eval/<name>/pass@k``
    when the run evaluated online); None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    metrics = list(metrics)
    # online evaluations (eval/<name>/pass@k): one more panel, every such key a line against the step
    evals = sorted({k for m in metrics for k in m if k.startswith("eval/") and "/pass@" in k})
    fig, axes = plt.subplots(1, len(keys) + bool(evals), figsize=(4 * (len(keys) + bool(evals)), 3))
    for ax, key in zip(axes, keys):
        pts = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts))
            if "kl" in key and all(v > 0 for _, v in pts):
                ax.set_yscale("log")
        ax.set_title(key)
        ax.set_xlabel("step")
    if evals:
        ax = axes[-1]
        for key in evals:
            pts = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
            ax.plot(*zip(*pts), marker="o", label=key.removeprefix("eval/"))
        ax.set_title("eval pass@k")
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return Path(path)


def ascii_curve(metrics: list[dict], key: str = "reward/mean", width: int = 50) -> str:
    """A text curve of ``key`` per step (a few rows), for the end-of-run summary."""
    pts = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
    if not pts:
        return ""
    stride = max(1, math.ceil(len(pts) / 20))
    lines = []
    for s, v in pts[::stride] + ([pts[-1]] if (len(pts) - 1) % stride else []):
        lines.append(f"  step {s:>4} {v:7.3f} |" + "#" * int(round(max(0.0, min(1.0, v)) * width)))
    return "\n".join(lines)
