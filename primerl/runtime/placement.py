"""Where the job runs: the device, the GPU of each trainer rank and of the embedded engine, the
trainer's precision, its process-group backend, and how weights reach the engine.

``device = "auto"`` is CUDA when torch sees a GPU, else the CPU. On GPUs (one node):

- one GPU: the trainer and the embedded engine share it (two processes on one device). The
  engine's KV cache is capped by ``inference.kv_cache_gb`` (0: no cap, it grows as requests
  need); the trainer's weights, optimizer state and activations take what is left. Weights go
  through the filesystem (NCCL cannot put two ranks of one group on one GPU).
- two or more: the engine on ``inference.gpu_ids`` (default GPU 0), trainer rank r (torchrun's
  LOCAL_RANK) on the r-th remaining GPU, as prime-rl places inference first and the trainer on
  the rest; weights by NCCL broadcast from trainer rank 0 (``inference.weight_update = "auto"``).
  With ``inference.backend = "vllm"`` the server is not ours: the trainer takes the GPUs not
  listed in ``inference.gpu_ids``.

Trainer ranks join a ``cuda:nccl,cpu:gloo`` process group on GPUs (tensors on the GPU go over
NCCL, the small host-side counters over gloo) and ``gloo`` on the CPU; the mesh is built on the
same device type. ``trainer.mixed_precision = "auto"`` is bf16 on CUDA (float32 master weights
and optimizer state, bf16 compute, float32 gradient reduction; FSDP2's ``MixedPrecisionPolicy``,
a one-rank mesh for a single process) and off on the CPU; the engine then samples in bf16 too.

Every inconsistency is a ``ConfigError`` naming the key, raised by ``validate.validate`` before any
process starts; ``primerl rl --dry-run`` prints :func:`describe_placement`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import ConfigError, RLConfig
from .inference.backend import get_backend
from .launch.kinds import get_launcher, trainer_ranks_per_node

if TYPE_CHECKING:
    import torch

__all__ = ["Placement", "resolve_placement", "describe_placement", "visible_gpus"]


def _torch_build_has_gpu() -> bool:
    """Whether the installed torch was built for CUDA or ROCm, read from its ``version.py`` without
    importing torch (~2.4 CPU-s): a CPU build sees no GPU, so the launcher and ``--dry-run`` of a
    CPU job never load torch. Unsure (torch already loaded, no such file): True, and torch is asked."""
    import importlib.util
    import re
    import sys
    from pathlib import Path

    if "torch" in sys.modules:
        return True
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False  # no torch at all: no GPU for it
    version = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = version.read_text()
    except OSError:
        return True
    builds = re.findall(r"^(cuda|hip)\s*(?::[^=]*)?=\s*(.+)$", text, flags=re.M)
    return not builds or any(v.strip() != "None" for _, v in builds)


def visible_gpus() -> int:
    """CUDA devices torch can use in this process (0 without a CUDA build or driver)."""
    if not _torch_build_has_gpu():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" or "cuda"
    trainer_gpus: tuple[int, ...]  # GPU index of trainer local rank r; () on the CPU
    engine_gpu: int | None  # the embedded engine's GPU; None on the CPU or with vLLM
    num_gpus: int  # visible to torch
    mixed_precision: bool  # bf16 compute over float32 master weights
    weight_update: str  # engine in process: "filesystem" or "broadcast"; servers elsewhere: the backend's name
    dtype: str  # "float32" or "bfloat16": what the trainer computes in (and the engine samples in)

    @property
    def param_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def shared(self) -> bool:
        """Trainer and engine on one GPU."""
        return self.engine_gpu is not None and self.engine_gpu in self.trainer_gpus

    @property
    def dist_backend(self) -> str:
        """Trainer ranks' default process group: NCCL for GPU tensors (gloo for host ones) or gloo."""
        return "cuda:nccl,cpu:gloo" if self.device == "cuda" else "gloo"

    @property
    def broadcast_backend(self) -> str:
        """The trainer -> engine weight group: NCCL when both sit on GPUs, gloo on the CPU."""
        return "nccl" if self.device == "cuda" else "gloo"

    def trainer_device(self, local_rank: int = 0) -> torch.device:
        import torch

        if self.device == "cpu":
            return torch.device("cpu")
        if not 0 <= local_rank < len(self.trainer_gpus):
            raise ConfigError(f"num_trainer_ranks: trainer local rank {local_rank} has no GPU (trainer GPUs "
                              f"{list(self.trainer_gpus)})")
        return torch.device("cuda", self.trainer_gpus[local_rank])

    def engine_device(self) -> torch.device:
        import torch

        return torch.device("cpu") if self.engine_gpu is None else torch.device("cuda", self.engine_gpu)


def resolve_placement(cfg: RLConfig, num_gpus: int | None = None) -> Placement:
    """The job's placement on a machine with ``num_gpus`` visible GPUs (default: this one's).
    Raises ``ConfigError`` naming the key when the config cannot be placed."""
    n = visible_gpus() if num_gpus is None else num_gpus
    spans_nodes = get_launcher(cfg).capabilities.spans_nodes
    if num_gpus is None and spans_nodes and cfg.deployment.gpus_per_node:
        n = cfg.deployment.gpus_per_node  # a node of the plan, not this (submitting) machine
    i, ranks = cfg.inference, cfg.num_trainer_ranks
    node_ranks = trainer_ranks_per_node(cfg)  # the GPUs are this node's
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device: must be auto, cpu or cuda, got {cfg.device!r}")
    device = ("cuda" if n else "cpu") if cfg.device == "auto" else cfg.device
    if device == "cuda" and n == 0:
        import torch

        raise ConfigError(f"device: 'cuda' but torch sees no CUDA device (torch {torch.__version__}, built for CUDA "
                          f"{torch.version.cuda}); use device = 'cpu' or 'auto'")
    backend = get_backend(cfg)
    embedded = backend.capabilities.engine_in_process  # the engine on one of our GPUs (else: servers elsewhere)
    if device == "cpu":
        if i.gpu_ids:
            raise ConfigError(f"inference.gpu_ids: set to {i.gpu_ids} but the job runs on the CPU (device = "
                              f"{cfg.device!r}{', no GPU visible' if not n else ''})")
        trainer_gpus, engine_gpu = (), None
    else:
        bad = [g for g in i.gpu_ids if g >= n]
        if bad:
            raise ConfigError(f"inference.gpu_ids: GPU(s) {bad} do not exist ({n} visible: 0..{n - 1})")
        if embedded and len(i.gpu_ids) > 1:
            raise ConfigError(f"inference.gpu_ids: the embedded engine runs on one GPU, got {i.gpu_ids} (several "
                              "inference GPUs need inference.backend = 'vllm')")
        if embedded and n == 1:  # one GPU: shared
            trainer_gpus, engine_gpu = (0,), 0
            if node_ranks > 1:
                raise ConfigError(f"num_trainer_ranks: {node_ranks} trainer ranks need {node_ranks} GPUs; "
                                  "this machine has 1, which the trainer shares with the engine")
        else:
            engine_ids = list(i.gpu_ids) or ([0] if embedded else [])
            rest = [g for g in range(n) if g not in engine_ids]
            if node_ranks > len(rest):
                raise ConfigError(f"num_trainer_ranks: {node_ranks} trainer ranks need {node_ranks} GPUs "
                                  f"but {len(rest)} of the {n} visible are left after the engine's "
                                  f"(inference.gpu_ids = {engine_ids})")
            trainer_gpus, engine_gpu = tuple(rest[:node_ranks]), (engine_ids[0] if embedded else None)
    mp = cfg.trainer.mixed_precision
    fsdp_ok = ranks == 1 or cfg.trainer.fsdp  # the policy is FSDP2's: replicated ranks have none
    if mp == "bf16" and not fsdp_ok:
        raise ConfigError("trainer.mixed_precision: 'bf16' is FSDP2's MixedPrecisionPolicy; with "
                          f"num_trainer_ranks = {ranks} it needs trainer.fsdp = true (or set it to 'off')")
    mixed = mp == "bf16" or (mp == "auto" and device == "cuda" and cfg.model.dtype == "float32" and fsdp_ok)
    if not embedded:
        update = backend.name  # the servers' own weight path (inference.vllm.weight_update for vLLM)
    elif i.weight_update == "auto":  # an orchestrator (or servers) on nodes of their own share no directory
        apart = cfg.deployment.orchestrator == "own" or cfg.deployment.inference_nodes > 0
        lora = cfg.trainer.lora.rank > 0  # adapter-only updates go as files (embedded_backend's LoRA channel)
        broadcast = apart or (device == "cuda" and engine_gpu not in trainer_gpus)
        update = "broadcast" if broadcast and not lora else "filesystem"
    else:
        update = i.weight_update
    if update == "broadcast" and device == "cuda" and engine_gpu in trainer_gpus:
        raise ConfigError("inference.weight_update: 'broadcast' needs the engine on a GPU of its own (NCCL cannot "
                          f"hold two ranks on one GPU; the engine shares GPU {engine_gpu} with the trainer): use "
                          "'filesystem' or 'auto'")
    return Placement(device, trainer_gpus, engine_gpu, n, mixed, update, "bfloat16" if mixed else cfg.model.dtype)


def describe_placement(cfg: RLConfig, num_gpus: int | None = None) -> str:
    """The placement as TOML comment lines (``primerl rl --dry-run`` prints them)."""
    p = resolve_placement(cfg, num_gpus)
    prec = ("bf16 compute, float32 master weights / optimizer state / gradient reduction" if p.mixed_precision
            else f"{p.dtype} throughout")
    lines = [f"# placement: device = {p.device} ({cfg.device!r}; {p.num_gpus} GPU(s) visible)"]
    if p.device == "cpu":
        lines.append(f"# trainer: {cfg.num_trainer_ranks} rank(s) on the CPU, {p.dist_backend}; {prec}")
    else:
        ranks = ", ".join(f"rank {r} -> cuda:{g}" for r, g in enumerate(p.trainer_gpus))
        lines.append(f"# trainer: {ranks}; process group {p.dist_backend}; {prec}")
    lines.append(get_backend(cfg).describe_placement(cfg, p))
    return "\n".join(lines) + "\n"
