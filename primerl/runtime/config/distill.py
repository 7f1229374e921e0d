"""``[distill]``: on-policy distillation from a teacher (``primerl.rl.distill_advantages``) and the
section's own checks. The teacher's files (its vocabulary against the student's) are checked in
``primerl.runtime.validate`` (``check_distill_teacher``), where the model config is at hand.

``teacher`` (or ``teachers = {<env id> = PATH}``, one per environment) is a primerl run directory
(``<output_dir>`` of a finished ``primerl rl``: its ``config.toml`` and latest checkpoint), one of
its checkpoints (``<output_dir>/checkpoints/step_N``) or a Hugging Face directory (``config.json``
+ safetensors). It is scored in the orchestrator's process (the default) or by a server at
``url`` (``primerl inference --role teacher`` started with this config, or a vLLM server of the
teacher: ``backend``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import _need

NORMALIZE = ("none", "token", "sequence")


@dataclass
class DistillConfig:
    teacher: str = ""  # "" = no distillation
    teachers: dict = field(default_factory=dict)  # {env id = PATH}: that environment's teacher (else teacher)
    coef: float = 1.0  # advantage = reward advantage + coef * (log pi_T - log pi_S)
    only: bool = False  # pure OPD: the reward advantage is left out (rewards are still logged)
    clip: float = 0.0  # > 0: clamp the per-token distillation advantage to [-clip, clip]
    normalize: str = "none"  # none, token (/ std over the step's tokens) or sequence (/ each sequence's std)
    url: str = ""  # "": score in the orchestrator's process; else the teacher's server
    backend: str = ""  # the protocol of url's server: an inference.backend name ("": inference.backend)
    timeout_s: float = 300.0  # a scoring request that takes longer fails the job, naming the teacher
    topk: int = 0  # > 0: the teacher also returns its k most likely tokens at every position, and the
    # trainer adds topk_coef * the forward KL from them (renormalised) to the student (0: off)
    topk_coef: float = 1.0


def distill_enabled(d: DistillConfig) -> bool:
    return bool(d.teacher or d.teachers)


def check_distill(d: DistillConfig) -> None:
    """``[distill]`` on its own."""
    _need(isinstance(d.teachers, dict) and all(isinstance(v, str) and v for v in d.teachers.values()),
          "distill.teachers", "must map environment ids to teacher paths ({env = PATH})", d.teachers)
    _need(d.coef > 0, "distill.coef", "must be > 0", d.coef)
    _need(d.clip >= 0, "distill.clip", "must be >= 0 (0: no clipping)", d.clip)
    _need(d.normalize in NORMALIZE, "distill.normalize", "must be none, token or sequence", d.normalize)
    _need(d.timeout_s > 0, "distill.timeout_s", "must be > 0", d.timeout_s)
    _need(isinstance(d.topk, int) and d.topk >= 0, "distill.topk", "must be an integer >= 0 (0: off)", d.topk)
    _need(d.topk_coef > 0, "distill.topk_coef", "must be > 0", d.topk_coef)
    on = distill_enabled(d)
    _need(on or not d.only, "distill.only", "pure distillation needs a teacher (distill.teacher)", d.only)
    _need(on or not d.topk, "distill.topk", "the teacher's top-k needs a teacher (distill.teacher)", d.topk)
    _need(on or not d.url, "distill.url", "a teacher server needs distill.teacher (the teacher it serves)", d.url)
    _need(not d.url or d.url.startswith(("http://", "https://")), "distill.url", "must be an http(s):// URL", d.url)
    _need(not (d.url and d.teachers), "distill.url",
          "one server serves one teacher: with distill.teachers (one per environment) score in-process", d.url)
