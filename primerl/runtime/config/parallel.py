"""``[trainer.parallel]``: the trainer's layout (``ParallelConfig``), its checks against
``num_trainer_ranks``, the model's heads and dims and the loss (``validate_parallel``: a layout is
only right for a world size and a model, so this one check of the trainer reads those too), and
the mesh as ``--dry-run`` prints it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ConfigError, _need

if TYPE_CHECKING:
    from .schema import RLConfig
    from .trainer import LossConfig


FP8_RECIPES = ("blockwise", "blockwise_fp8_wgrad", "rowwise")
_FP8_BLOCK = 128


@dataclass
class ParallelConfig:
    """The trainer's layout over ``num_trainer_ranks`` (``primerl.parallel.ParallelDims``):
    ``dp_replicate * dp_shard * cp`` ranks; ``ep`` borrows from ``dp_shard * cp``."""

    dp_replicate: int = 1  # HSDP replicas (gradients all-reduced between them)
    dp_shard: int = -1  # FSDP shards; -1: the ranks that dp_replicate and cp leave
    cp: int = 1  # context parallel: each packed micro-batch split over cp ranks (ring attention)
    ep: int = 1  # expert parallel: experts split over ep ranks (token all-to-all)
    activation_checkpointing: str = "none"  # "none", "full" (every block) or "selective" (every 2nd block)
    fp8: str = "off"  # "off", "blockwise", "blockwise_fp8_wgrad" or "rowwise" (primerl.kernels.fp8_training recipes)
    cp_layout: str = "zigzag"  # "zigzag" (causal load balance) or "contiguous"
    cp_kind: str = "ring"  # "ring", "ulysses" (head all-to-all) or "ulysses_ring" (2-D: cp = cp_ulysses x ring)
    cp_ulysses: int = 0  # Ulysses degree; 0: cp for "ulysses", 1 for "ring"; required for "ulysses_ring"
    activation_offload: bool = False  # checkpointed blocks' saved activations kept in host memory
    cpu_offload: bool = False  # parameters, gradients and optimizer state on the host (FSDP2 CPUOffloadPolicy)


def parallel_dims(cfg: RLConfig):
    """``primerl.parallel.ParallelDims`` of ``trainer.parallel`` over ``num_trainer_ranks``
    (ConfigError naming the key when the sizes do not fit)."""
    from primerl.parallel.mesh import ParallelDims

    p = cfg.trainer.parallel
    try:
        return ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, ep=p.ep,
                           world_size=cfg.num_trainer_ranks)
    except ValueError as e:
        raise ConfigError(f"trainer.parallel (num_trainer_ranks = {cfg.num_trainer_ranks}): {e}") from None


def _model_dims(cfg: RLConfig) -> dict[str, int]:
    m = cfg.model
    if not m.path:
        return {"num_experts": m.num_experts, "dim": m.dim, "moe_dim": m.moe_dim}
    from primerl.models.config import MoETransformerConfig

    mc = MoETransformerConfig.from_hf(m.path)
    return {"num_experts": mc.num_experts, "dim": mc.dim, "moe_dim": mc.moe_dim}


def _sequence_level_loss(loss: LossConfig) -> str | None:
    """What in the loss needs whole sequences on one rank (None: all terms are per token)."""
    if loss.method in ("gspo", "gspo_token"):
        return f"trainer.loss.method = {loss.method!r}"
    if loss.aggregation == "seq_mean_token_mean":
        return "trainer.loss.aggregation = 'seq_mean_token_mean'"
    for c in ("geo_rs", "veto", "sequence_mask"):
        if c in loss.corrections:
            return f"trainer.loss.corrections contains {c!r}"
    if "mis" in loss.corrections and loss.hparams.get("mis_level") == "sequence":
        return "trainer.loss.hparams.mis_level = 'sequence'"
    return None


CP_KINDS = ("ring", "ulysses", "ulysses_ring")


def cp_degrees(p: ParallelConfig, cp: int) -> tuple[int, int]:
    """``(ulysses, ring)`` degrees of context parallelism ``cp`` for ``trainer.parallel``."""
    if p.cp_kind == "ring":
        u = p.cp_ulysses or 1
    elif p.cp_kind == "ulysses":
        u = p.cp_ulysses or cp
    else:
        u = p.cp_ulysses
    return u, cp // u


def _attention_heads(cfg: RLConfig) -> tuple[int, int]:
    """(query heads, KV heads) of the policy model (MLA: the dense form's per-head K/V, KV = query heads)."""
    m = cfg.model
    if not m.path:
        return m.n_heads, m.n_kv_heads
    from primerl.models.config import MoETransformerConfig

    mc = MoETransformerConfig.from_hf(m.path)
    return mc.n_heads, mc.n_kv_heads


def validate_cp_split(cfg: RLConfig, cp: int) -> None:
    """The context-parallel kind and degrees against cp and the model's heads: a Ulysses degree U
    must divide cp and the query heads; KV heads must divide by U, or U by them (then each KV head
    is replicated U / Hkv times, not an error)."""
    p = cfg.trainer.parallel
    _need(p.cp_kind != "ring" or p.cp_ulysses in (0, 1), "trainer.parallel.cp_ulysses",
          "must be 0 or 1 with cp_kind = 'ring' (use 'ulysses' or 'ulysses_ring' for a Ulysses degree)", p.cp_ulysses)
    _need(p.cp_kind != "ulysses" or p.cp_ulysses in (0, cp), "trainer.parallel.cp_ulysses",
          f"must be 0 or cp = {cp} with cp_kind = 'ulysses' (a Ulysses degree below cp is cp_kind = 'ulysses_ring')",
          p.cp_ulysses)
    if cp == 1 or p.cp_kind == "ring":
        return
    u, ring = cp_degrees(p, cp)
    _need(p.cp_kind != "ulysses_ring" or ring > 1, "trainer.parallel.cp_ulysses",
          f"must be below cp = {cp} with cp_kind = 'ulysses_ring' (ring degree cp / cp_ulysses = {ring}; "
          "use cp_kind = 'ulysses')", p.cp_ulysses)
    heads, kv_heads = _attention_heads(cfg)
    _need(heads % u == 0, "trainer.parallel.cp_ulysses" if p.cp_ulysses else "trainer.parallel.cp",
          f"Ulysses degree {u} must divide the model's {heads} attention heads", p.cp_ulysses or cp)
    _need(kv_heads % u == 0 or u % kv_heads == 0,
          "trainer.parallel.cp_ulysses" if p.cp_ulysses else "trainer.parallel.cp",
          f"Ulysses degree {u} and the model's {kv_heads} KV heads: one must divide the other (fewer KV heads "
          "are replicated)", p.cp_ulysses or cp)


def validate_parallel(cfg: RLConfig) -> None:
    """``trainer.parallel`` against ``num_trainer_ranks``, the model and the loss."""
    p, t = cfg.trainer.parallel, cfg.trainer
    _need(p.activation_checkpointing in ("none", "full", "selective"), "trainer.parallel.activation_checkpointing",
          "must be none, full or selective", p.activation_checkpointing)
    _need(p.fp8 in ("off",) + FP8_RECIPES, "trainer.parallel.fp8", f"must be 'off' or one of {FP8_RECIPES}", p.fp8)
    _need(p.cp_layout in ("zigzag", "contiguous"), "trainer.parallel.cp_layout", "must be zigzag or contiguous",
          p.cp_layout)
    _need(p.cp_kind in CP_KINDS, "trainer.parallel.cp_kind", f"must be one of {CP_KINDS}", p.cp_kind)
    dims = parallel_dims(cfg)
    _need(p.cp_ulysses >= 0 and (p.cp_ulysses == 0 or dims.cp % p.cp_ulysses == 0), "trainer.parallel.cp_ulysses",
          f"must divide trainer.parallel.cp = {dims.cp} (cp = cp_ulysses x ring degree)", p.cp_ulysses)
    _need(p.cp_kind != "ulysses_ring" or p.cp_ulysses > 1, "trainer.parallel.cp_ulysses",
          "must be set (> 1) with cp_kind = 'ulysses_ring'", p.cp_ulysses)
    validate_cp_split(cfg, dims.cp)
    _need(not p.activation_offload or p.activation_checkpointing != "none", "trainer.parallel.activation_offload",
          "needs trainer.parallel.activation_checkpointing = 'full' or 'selective' (it offloads the checkpointed "
          "blocks' saved inputs)", p.activation_offload)
    _need(not p.cpu_offload or t.fsdp, "trainer.parallel.cpu_offload",
          "needs trainer.fsdp = true (FSDP2's CPUOffloadPolicy)", p.cpu_offload)
    if dims.cp > 1:
        _need(t.attention != "padded", "trainer.attention",
              f"'padded' cannot run with trainer.parallel.cp = {dims.cp} (context parallel needs ring attention; "
              "use 'auto' or 'kernel')", t.attention)
        seq_level = _sequence_level_loss(t.loss)
        _need(seq_level is None, "trainer.parallel.cp",
              f"must be 1 with a sequence-level loss term ({seq_level}): under context parallelism a rank holds "
              "only part of each sequence", dims.cp)
    if not t.fsdp:
        _need(dims.cp == 1 and dims.ep == 1 and dims.dp_replicate == 1, "trainer.fsdp",
              "false (replicated weights) only works without cp, ep and dp_replicate (set trainer.fsdp = true)",
              {"cp": dims.cp, "ep": dims.ep, "dp_replicate": dims.dp_replicate})
    if dims.ep == 1 and p.fp8 == "off":
        return
    md = _model_dims(cfg)
    _need(md["num_experts"] % dims.ep == 0, "trainer.parallel.ep",
          f"must divide the model's num_experts = {md['num_experts']}", dims.ep)
    if p.fp8 != "off":
        bad = {k: md[k] for k in ("dim", "moe_dim") if md[k] % _FP8_BLOCK}
        _need(not bad, "trainer.parallel.fp8",
              f"{p.fp8!r} needs model dims that are multiples of {_FP8_BLOCK} (the FP8 block size) so the experts "
              f"and projections run in FP8; not multiples: {bad}", p.fp8)


def describe_parallel(cfg: RLConfig) -> str:
    """The trainer mesh's named view sizes, as TOML comment lines (``--dry-run`` prints them)."""
    dims = parallel_dims(cfg)
    views = " ".join(f"{k}={v}" for k, v in dims.view_sizes().items())
    p = cfg.trainer.parallel
    return (f"# trainer mesh over {dims.world_size} rank(s): {views}\n"
            f"# each cp rank holds seq_len / cp = {cfg.orchestrator.seq_len / dims.cp:g} tokens of a micro-batch; "
            f"fp8 = {p.fp8}; activation_checkpointing = {p.activation_checkpointing}\n"
            f"{describe_cp(cfg, dims.cp)}")


def describe_cp(cfg: RLConfig, cp: int) -> str:
    """One comment line: the context-parallel kind, its Ulysses x ring degrees and the offloads."""
    p = cfg.trainer.parallel
    if cp == 1:
        kind = "cp = 1 (no context parallelism)"
    else:
        u, ring = cp_degrees(p, cp)
        kind = f"cp = {cp}: cp_kind = {p.cp_kind}, ulysses = {u} x ring = {ring}, layout = {p.cp_layout}"
    return (f"# {kind}; activation_offload = {str(p.activation_offload).lower()}; "
            f"cpu_offload = {str(p.cpu_offload).lower()}\n")
