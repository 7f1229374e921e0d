"""Samples on disk for debugging (``orchestrator.save_samples = true``): every trained step's
samples as ``<output_dir>/samples/step_N.jsonl``, one JSON object per sample (written to a temporary
file, then renamed: a reader never sees half a step)::

    {"step": n, "group": g, "member": m, "attempt": a,
     "input_ids": [...], "loss_mask": [0/1 ...], "inference_logprobs": [...],   # aligned per token
     "reward": r, "advantage": A, "policy_version_min": v0, "policy_version_max": v1,
     "servers": ["embedded" | url, ...], "turns": t, "loss_weights": [...] | null}

The verifiers path writes one line per trained branch, with ``agent``, ``trace`` and ``branch``
added and ``attempt`` absent; ``servers`` is the generate route the harness called.

``policy_version_min`` is the oldest policy version that produced one of its tokens (what the
staleness bound ``orchestrator.max_off_policy_steps`` counts), ``policy_version_max`` the newest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["episode_record", "sample_record", "write_samples", "samples_path"]


def samples_path(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "samples" / f"step_{step}.jsonl"


def sample_record(sample, *, step: int, group: int, member: int, reward: float, version_min: int | None,
                  version_max: int | None, servers: list[str], turns: int, extra: dict | None = None) -> dict:
    """A trained ``Sample`` and what the orchestrator knows of it -> one JSON line."""
    adv = sample.advantages
    return {"step": step, "group": group, "member": member, **(extra or {}),
            "input_ids": sample.input_ids.tolist(), "loss_mask": sample.loss_mask.int().tolist(),
            "inference_logprobs": sample.inference_logprobs.tolist(), "reward": reward,
            "advantage": adv.tolist() if hasattr(adv, "tolist") else float(adv), "policy_version_min": version_min,
            "policy_version_max": version_max, "servers": list(servers), "turns": turns,
            "loss_weights": None if sample.loss_weights is None else sample.loss_weights.tolist()}


def episode_record(st, sample) -> dict:
    """An ``EpisodeState`` (built-in path) and the ``Sample`` built from it -> one JSON line."""
    return sample_record(sample, step=st.step, group=st.group, member=st.member, reward=st.reward,
                         version_min=st.version_min, version_max=st.version_max, servers=st.servers, turns=st.turn,
                         extra={"attempt": st.attempt})


def write_samples(output_dir: str | Path, step: int, records: list[dict]) -> Path:
    path = samples_path(output_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return path
