"""LoRA on a MoETransformer: ``apply_lora``, ``merge_lora`` / ``unmerge_lora``.

A target module keeps its frozen base weight where it was (same parameter names, so checkpoints,
FSDP and FP8 conversion see the model as before) and gains two trainable factors; its forward adds
``scale * B @ A`` applied to the input, ``scale = alpha / rank``:

    linear   y = base(x) + scale * (dropout(x) @ A.T) @ B.T       A [r, in], B [out, r]
    experts  per expert e: gate_up = x W13_e.T + scale * x A13_e.T B13_e.T   A13 [E, r, D], B13 [E, 2I, r]
                           down    = h W2_e.T  + scale * h A2_e.T  B2_e.T    A2 [E, r, I],  B2 [E, D, r]

(the fused gate/up weight gets one adapter, as PEFT's ``target_parameters`` gives Hugging Face's
fused ``gate_up_proj``). A starts Kaiming-uniform, B at zero: a fresh adapter changes nothing.

Targets (``TARGETS``): the attention projections by their Hugging Face names (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``; MLA's ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_b_proj``), ``"attention"`` for every projection the model's attention has, ``"mlp"`` (the dense
layers' gate/up/down), ``"shared_experts"`` and ``"experts"`` (the routed experts).

FP8: a module converted by :func:`primerl.models.convert_to_fp8` keeps its FP8 GEMM for the base;
the low-rank path runs in the activations' precision. Routed experts under an FP8 recipe run the
two grouped GEMMs through :func:`primerl.kernels.fp8_training.fp8_grouped_linear`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
GROUPS = ("attention", "mlp", "shared_experts", "experts")
TARGETS = ATTENTION_PROJS + GROUPS
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")


class LoRAError(ValueError):
    """A LoRA request the model cannot take (rank, targets, modules, adapter files); names the key/tensor."""


@dataclass
class LoRASpec:
    """What :func:`apply_lora` applied: rank, alpha, the requested targets and the adapted modules
    (``modules``: model-relative names, e.g. ``layers.0.attention.q_proj``, ``layers.1.ffn.experts``)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0
    modules: list[str] = field(default_factory=list)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# --------------------------------------------------------------------------------------------- linear
class LoRALinearMixin:
    """Mixed into the class of an ``nn.Linear`` (or its FP8 subclass) by :func:`apply_lora`:
    ``lora_A [r, in]``, ``lora_B [out, r]`` and ``lora_scale``; the base forward is the class's own."""

    lora_scale: float
    lora_merged: bool
    lora_disabled: bool  # adapters_disabled(): the base alone (the KL reference of a LoRA job)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_merged or self.lora_disabled:
            return super().forward(x)
        if isinstance(self.lora_dropout, nn.Identity):  # one op: base GEMM (bf16 or FP8) + the low-rank path
            from primerl.kernels.lora import lora_linear

            return lora_linear(x, self.weight, self.lora_A.to(x.dtype), self.lora_B.to(x.dtype), self.lora_scale,
                               bias=self.bias, fp8_recipe=getattr(self, "recipe", None) if _is_fp8(self) else None,
                               backend=getattr(self, "backend", None))
        y = super().forward(x)
        return y + low_rank(self.lora_dropout(x), self.lora_A, self.lora_B, self.lora_scale).to(y.dtype)

    def lora_delta(self) -> torch.Tensor:
        """``scale * B @ A`` ``[out, in]`` in float32."""
        return self.lora_scale * (self.lora_B.float() @ self.lora_A.float())


def _is_fp8(module: nn.Module) -> bool:
    from primerl.kernels.fp8_training import Fp8Linear

    return isinstance(module, Fp8Linear)


def low_rank(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * (x @ a.T) @ b.T``: x [..., in], a [r, in], b [out, r] -> [..., out]."""
    return F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * scale


_LORA_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if cls not in _LORA_CLASSES:
        _LORA_CLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRALinearMixin, cls), {"__module__": __name__})
    return _LORA_CLASSES[cls]


def _wrap_linear(name: str, lin: nn.Linear, spec: LoRASpec) -> None:
    if not isinstance(lin, nn.Linear):
        raise LoRAError(f"apply_lora: {name} is a {type(lin).__name__}, not a linear layer")
    w = lin.weight
    if not (w.is_floating_point() and w.element_size() >= 2):
        raise LoRAError(f"apply_lora: {name}.weight is stored as {w.dtype}: LoRA cannot pair with a weight held in "
                        "FP8 storage (it could not be merged); convert after loading a high-precision base")
    kw = dict(device=w.device, dtype=w.dtype)
    lin.__class__ = _lora_class(type(lin))
    lin.lora_A = nn.Parameter(torch.empty(spec.rank, lin.in_features, **kw))
    lin.lora_B = nn.Parameter(torch.zeros(lin.out_features, spec.rank, **kw))
    nn.init.kaiming_uniform_(lin.lora_A, a=math.sqrt(5))
    lin.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
    lin.lora_scale = spec.scale
    lin.lora_merged = lin.lora_disabled = False


# -------------------------------------------------------------------------------------------- experts
def _wrap_experts(name: str, experts: nn.Module, spec: LoRASpec) -> None:
    E, two_i, D = experts.w13.shape
    kw = dict(device=experts.w13.device, dtype=experts.w13.dtype)
    r = spec.rank
    experts.lora_A13 = nn.Parameter(torch.empty(E, r, D, **kw))
    experts.lora_B13 = nn.Parameter(torch.zeros(E, two_i, r, **kw))
    experts.lora_A2 = nn.Parameter(torch.empty(E, r, two_i // 2, **kw))
    experts.lora_B2 = nn.Parameter(torch.zeros(E, D, r, **kw))
    for a in (experts.lora_A13, experts.lora_A2):
        for e in range(E):
            nn.init.kaiming_uniform_(a.data[e], a=math.sqrt(5))
    experts.lora_scale = spec.scale
    experts.lora_merged = experts.lora_disabled = False


def experts_lora_active(experts: nn.Module) -> bool:
    """The routed experts run their adapters' path (adapters there, neither merged nor disabled)."""
    return getattr(experts, "lora_A13", None) is not None and not (experts.lora_merged or experts.lora_disabled)


def _base_grouped(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, fp8_recipe) -> torch.Tensor:
    if fp8_recipe is not None:
        from primerl.kernels.fp8_training import fp8_grouped_linear
        from primerl.kernels.moe.fp8 import recipe_name

        return fp8_grouped_linear(x, w, ends.to(torch.int32), recipe=recipe_name(fp8_recipe))
    from primerl.kernels.gemm import grouped_gemm_nt

    return grouped_gemm_nt(x, w, ends.to(torch.int32), layout="offsets")


def grouped_low_rank(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Per-expert ``scale * (x_e @ a_e.T) @ b_e.T`` over rows grouped by expert: x [M, d],
    a [E, r, d], b [E, n, r], ends [E] (group e's end row) -> [M, n]."""
    from primerl.kernels.lora import grouped_lora

    return grouped_lora(x, a.to(x.dtype), b.to(x.dtype), scale, offsets=ends.to(torch.int32))


def experts_lora_on_grouped_rows(experts: nn.Module, x_perm: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The expert MLPs with their adapters on rows grouped by expert: x_perm [M, D] -> [M, D] (unweighted)."""
    s, rec = experts.lora_scale, experts.fp8_recipe
    gu = _base_grouped(x_perm, experts.w13, ends, rec) + grouped_low_rank(x_perm, experts.lora_A13,
                                                                          experts.lora_B13, ends, s)
    g, u = gu.chunk(2, dim=-1)
    h = (F.silu(g.float()) * u.float()).to(x_perm.dtype)
    return _base_grouped(h, experts.w2, ends, rec) + grouped_low_rank(h, experts.lora_A2, experts.lora_B2, ends, s)


def experts_lora_forward(experts: nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts with adapters: x [T, D], topk [T, k] -> y [T, D] (weighted sum over k)."""
    from primerl.kernels.moe import permute, unpermute_combine

    E = experts.w13.shape[0]
    x_perm, row_map, ends = permute(x, topk_ids, E, backend=experts.backend)
    y_perm = experts_lora_on_grouped_rows(experts, x_perm, ends)
    return unpermute_combine(y_perm, row_map, topk_weights.float(), backend=experts.backend)


def experts_delta(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale * B @ A`` per expert, float32: ([E, 2I, D], [E, D, I])."""
    s = experts.lora_scale
    return (s * torch.bmm(experts.lora_B13.float(), experts.lora_A13.float()),
            s * torch.bmm(experts.lora_B2.float(), experts.lora_A2.float()))


# ------------------------------------------------------------------------------------------ selection
def _attention_projs(attn: nn.Module) -> list[str]:
    return [p for p in ATTENTION_PROJS if isinstance(getattr(attn, p, None), nn.Linear)]


def resolve_targets(model: nn.Module, targets) -> dict[str, str]:
    """``{module name: kind}`` (kind "linear" or "experts") of the modules ``targets`` select on
    ``model`` (None: every group the model has); raises :class:`LoRAError` naming an unknown target
    or one the model does not have."""
    explicit = targets is not None
    if targets is None:
        targets = GROUPS
    if isinstance(targets, str):
        targets = (targets,)
    targets = tuple(targets)
    if not targets:
        raise LoRAError("apply_lora: targets is empty; choose among " + ", ".join(TARGETS))
    for t in targets:
        if t not in TARGETS:
            raise LoRAError(f"apply_lora: unknown target {t!r}; choose among {', '.join(TARGETS)}")
    cfg = model.config
    out: dict[str, str] = {}
    hit = {t: False for t in targets}
    for i, layer in enumerate(model.layers):
        attn = layer.attention
        for p in _attention_projs(attn):
            if p in targets or "attention" in targets:
                if p == "kv_b_proj" and getattr(cfg, "is_sparse", False):
                    raise LoRAError(f"apply_lora: target {p!r} on layers.{i}.attention: the sparse (absorbed) "
                                    "attention of this model reads kv_b_proj's weight as a matrix, which a LoRA "
                                    "adapter cannot pair with; leave kv_b_proj out of targets")
                out[f"layers.{i}.attention.{p}"] = "linear"
                hit[p if p in targets else "attention"] = True
        if not layer.is_moe:
            if "mlp" in targets:
                for p in MLP_PROJS:
                    out[f"layers.{i}.ffn.{p}"] = "linear"
                hit["mlp"] = True
            continue
        if "shared_experts" in targets and layer.ffn.shared_experts is not None:
            for p in MLP_PROJS:
                out[f"layers.{i}.ffn.shared_experts.{p}"] = "linear"
            hit["shared_experts"] = True
        if "experts" in targets:
            out[f"layers.{i}.ffn.experts"] = "experts"
            hit["experts"] = True
    missing = [t for t, h in hit.items() if not h and t != "attention"]
    if missing and explicit:
        raise LoRAError(f"apply_lora: target {missing[0]!r} matches no module of this {cfg.family} model")
    return out


def check_lora_args(rank, alpha, dropout) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"apply_lora: rank must be an integer >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise LoRAError(f"apply_lora: alpha must be a positive number, got {alpha!r}")
    if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
        raise LoRAError(f"apply_lora: dropout must be in [0, 1), got {dropout!r}")


def apply_lora(model: nn.Module, rank: int, alpha: float, targets=None, dropout: float = 0.0) -> nn.Module:
    """Add LoRA adapters of ``rank`` (scale ``alpha / rank``) to the ``targets`` of a MoETransformer
    (names of ``TARGETS``; None: every attention projection, dense MLP, shared and routed experts the
    model has; a named target the model lacks is an error) and freeze everything else
    (``requires_grad`` off on every base parameter); returns the model.

    ``model.lora`` is the :class:`LoRASpec`. ``dropout`` applies to a linear's input on the low-rank
    path; the routed experts take none (their adapter acts on grouped rows, as PEFT's
    ``target_parameters``, which refuses dropout too). Call before :func:`primerl.models.parallelize`.
    """
    check_lora_args(rank, alpha, dropout)
    if getattr(model, "lora", None) is not None:
        raise LoRAError("apply_lora: this model already has LoRA adapters (model.lora)")
    chosen = resolve_targets(model, targets)
    if dropout and "experts" in chosen.values():
        raise LoRAError(f"apply_lora: dropout={dropout} with target 'experts': the routed experts' adapter takes no "
                        "dropout (as PEFT's target_parameters); set dropout to 0 or leave 'experts' out")
    if targets is None:
        targets = GROUPS
    spec = LoRASpec(rank=rank, alpha=float(alpha), targets=tuple([targets] if isinstance(targets, str) else targets),
                    dropout=float(dropout), modules=list(chosen))
    for p in model.parameters():
        p.requires_grad_(False)
    modules = dict(model.named_modules())
    for name, kind in chosen.items():
        if kind == "linear":
            _wrap_linear(name, modules[name], spec)
        else:
            _wrap_experts(name, modules[name], spec)
    model.lora = spec
    return model


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' parameters by model name (``...q_proj.lora_A``, ``...experts.lora_B13``)."""
    return {n: p for n, p in model.named_parameters() if _is_lora_name(n)}


def _is_lora_name(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("lora_")


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    spec = getattr(model, "lora", None)
    if spec is None:
        raise LoRAError("this model has no LoRA adapters (apply_lora first)")
    mods = dict(model.named_modules())
    return {n: mods[n] for n in spec.modules}


@torch.no_grad()
def _add_delta(module: nn.Module, sign: float) -> None:
    if hasattr(module, "w13"):
        d13, d2 = experts_delta(module)
        module.w13.add_((sign * d13).to(module.w13.dtype))
        module.w2.add_((sign * d2).to(module.w2.dtype))
    else:
        module.weight.add_((sign * module.lora_delta()).to(module.weight.dtype))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within the block ``model`` computes its base alone: every adapted module skips its low-rank
    path (the adapters stay, untouched). The KL reference of a LoRA job is the policy in this state,
    not a copy of the base. Not for a merged model (its weights hold the adapters)."""
    mods = lora_modules(model)
    if any(m.lora_merged for m in mods.values()):
        raise LoRAError("adapters_disabled: the adapters are merged into the weights (unmerge_lora first)")
    for m in mods.values():
        m.lora_disabled = True
    try:
        yield model
    finally:
        for m in mods.values():
            m.lora_disabled = False


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (``W += scale * B @ A``); the forward then runs the
    base alone until :func:`unmerge_lora`. A bf16 base rounds the sum: merge then unmerge restores
    the weights to within that rounding, not bitwise."""
    for name, m in lora_modules(model).items():
        if m.lora_merged:
            raise LoRAError(f"merge_lora: {name} is already merged")
    for m in lora_modules(model).values():
        _add_delta(m, 1.0)
        m.lora_merged = True
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    """Undo :func:`merge_lora` (``W -= scale * B @ A`` with the adapters as they are now)."""
    for name, m in lora_modules(model).items():
        if not m.lora_merged:
            raise LoRAError(f"unmerge_lora: {name} is not merged")
    for m in lora_modules(model).values():
        _add_delta(m, -1.0)
        m.lora_merged = False
    return model
