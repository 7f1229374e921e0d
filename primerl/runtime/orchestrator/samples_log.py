"""Samples on disk for debugging (``orchestrator.save_samples = true``): every trained step's
samples as ``<output_dir>/samples/step_N.jsonl``, one JSON object per sample (written to a temporary
file, then renamed: a reader never sees half a step)::

    {"step": n, "group": g, "member": m, "attempt": a,
     "input_ids": [...], "loss_mask": [0/1 ...], "inference_logprobs": [...],   # aligned per token
     "reward": r, "advantage": A, "policy_version_min": v0, "policy_version_max": v1,
     "servers": ["embedded" | url, ...], "turns": t, "loss_weights": [...] | null}

``policy_version_min`` is the oldest policy version that produced one of its tokens (what the
staleness bound ``orchestrator.max_off_policy_steps`` counts), ``policy_version_max`` the newest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["episode_record", "write_samples", "samples_path"]


def samples_path(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "samples" / f"step_{step}.jsonl"


def episode_record(st, sample) -> dict:
    """An ``EpisodeState`` and the ``Sample`` built from it -> one JSON line."""
    return {"step": st.step, "group": st.group, "member": st.member, "attempt": st.attempt,
            "input_ids": sample.input_ids.tolist(), "loss_mask": sample.loss_mask.int().tolist(),
            "inference_logprobs": sample.inference_logprobs.tolist(), "reward": st.reward,
            "advantage": float(sample.advantages), "policy_version_min": st.version_min,
            "policy_version_max": st.version_max, "servers": list(st.servers), "turns": st.turn,
            "loss_weights": None if sample.loss_weights is None else sample.loss_weights.tolist()}


def write_samples(output_dir: str | Path, step: int, records: list[dict]) -> Path:
    path = samples_path(output_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return path
