"""``[orchestrator]``: the rollout loop (batch and group sizes, asynchrony, advantages, packing,
how batches reach the trainer) and the section's own checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from .data import CurriculumConfig, check_filter
from .errors import _need

ADVANTAGES = ("grpo", "drgrpo", "rloo", "rloo_std", "max_rl")

@dataclass
class OrchestratorConfig:
    batch_size: int = 32  # prompts per step
    group_size: int = 8  # rollouts per prompt
    max_async_level: int = 1  # policy versions between the sampler and the trainer (0 = synchronous)
    max_off_policy_steps: int = 4  # samples older than this are discarded and counted
    advantage: str = "drgrpo"  # grpo, drgrpo, rloo, rloo_std (/ std of the step's rewards) or max_rl
    seq_len: int = 2048  # tokens per packed micro-batch
    weights_timeout_s: float = 300.0
    # rollout batches to the trainer ranks: "filesystem" (files under output_dir/transport), "zmq"
    # (TCP, ZeroMQ ROUTER/DEALER: no filesystem shared between orchestrator and trainer nodes) or
    # "auto": zmq when the deployment spans nodes (kind nodes / slurm), filesystem on one machine
    batch_transport: str = "auto"
    zmq_host: str = ""  # where trainer ranks reach the orchestrator; "": its node in the plan (127.0.0.1 locally)
    zmq_port: int = 29620
    metrics_port: int = 0  # > 0: serve GET /metrics (Prometheus) and /health on this port; 0: off
    metrics_host: str = "127.0.0.1"
    save_samples: bool = False  # write each step's trained samples to <output_dir>/samples/step_N.jsonl
    # "dapo": a group whose rewards are all equal is dropped and replaced by a fresh prompt's group
    # (counted groups/filtered), at most max_oversample x batch_size groups per batch (then kept)
    filter: str = "none"
    max_oversample: float = 4.0
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)  # [orchestrator.curriculum]



def check_orchestrator(o: OrchestratorConfig) -> None:
    """``[orchestrator]`` on its own."""
    _need(o.batch_size >= 1, "orchestrator.batch_size", "must be >= 1", o.batch_size)
    _need(o.group_size >= 2, "orchestrator.group_size", "must be >= 2 (advantages compare samples of a prompt)",
          o.group_size)
    _need(o.max_async_level >= 0, "orchestrator.max_async_level", "must be >= 0", o.max_async_level)
    _need(o.max_off_policy_steps >= o.max_async_level, "orchestrator.max_off_policy_steps",
          f"must be >= max_async_level ({o.max_async_level})", o.max_off_policy_steps)
    _need(o.advantage in ADVANTAGES, "orchestrator.advantage", "must be grpo, drgrpo, rloo, rloo_std or max_rl",
          o.advantage)
    _need(o.seq_len >= 8, "orchestrator.seq_len", "must be >= 8", o.seq_len)
    _need(o.weights_timeout_s > 0, "orchestrator.weights_timeout_s", "must be > 0", o.weights_timeout_s)
    _need(o.batch_transport in ("auto", "filesystem", "zmq"), "orchestrator.batch_transport",
          "must be auto, filesystem or zmq", o.batch_transport)
    _need(0 < o.zmq_port < 65536, "orchestrator.zmq_port", "must be a TCP port", o.zmq_port)
    _need(0 <= o.metrics_port <= 65535, "orchestrator.metrics_port", "must be a TCP port (0: off)", o.metrics_port)
    check_filter(o)
