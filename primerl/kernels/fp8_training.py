"""FP8 training: ``fp8_linear`` / ``fp8_grouped_linear`` with autograd, and ``convert_to_fp8``.

Recipes (DeepSeek-V3's blockwise scheme):

* ``"blockwise"``: forward ``y = x @ w.T`` and dgrad ``dx = dy @ w`` in FP8 (activations and
  output gradients quantized per 1x128 token group, weights per 128x128 block; the transposed
  weight reuses the same blocks), wgrad ``dw = dy.T @ x`` from the bf16 tensors, float32 accumulation.
* ``"blockwise_fp8_wgrad"``: wgrad in FP8 too, with ``dy`` and ``x`` quantized column-wise in
  128-token blocks that never cross a group boundary (:func:`quant_per_group_colwise`).
* ``"rowwise"``: torchao's / torchtitan's recipe: all three GEMMs in FP8 with one float32 scale per
  row along each GEMM's contraction dim, on ``torch._scaled_mm`` / ``torch._scaled_grouped_mm``
  (CPU: the dequantizing emulation); see :mod:`.fp8_rowwise`.

Both ops are ``torch.library.custom_op``s (forward and backward each one op, with fake kernels
and ``register_autograd``), so ``torch.compile`` traces them as single nodes. Tensors saved for
backward are the high-precision ``x`` and ``weight`` (quantized again in backward).

Module swap protocol (:func:`convert_to_fp8`, which reports what it converted and what it kept and
why in ``model.fp8_conversion``): exact ``nn.Linear`` modules become
:class:`Fp8Linear` (class swap in place: parameters, hooks and optimizer state are untouched).
Any module with a method ``enable_fp8(recipe: str) -> None`` (e.g. the project's grouped experts)
is asked to switch itself: it must route its grouped GEMMs through :func:`fp8_grouped_linear`
(or the FP8 grouped GEMMs of :mod:`primerl.kernels.gemm`) with that recipe, raise ``ValueError``
for dims that are not multiples of 128, and owns its submodules (convert_to_fp8 does not descend
into it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from . import gemm as _gemm
from .fp8 import quant_per_block, quant_per_token_group

RECIPES = ("blockwise", "blockwise_fp8_wgrad", "rowwise")
BLOCK = 128
__all__ = ["RECIPES", "fp8_linear", "fp8_grouped_linear", "Fp8Linear", "Fp8ConversionReport", "convert_to_fp8"]


def _quant_backend(backend: Optional[str]) -> Optional[str]:
    return backend if backend in ("torch", "triton") else None


def _plain_backend(backend: Optional[str]) -> Optional[str]:
    """Backend for the ops DeepGEMM does not cover (k-grouped, colwise quant)."""
    return backend if backend in ("torch", "triton") else None


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


def _transposed_blocks(wq: torch.Tensor, wsf: torch.Tensor):
    """Block quantization of w.T from that of w: 128x128 blocks map onto themselves."""
    return wq.transpose(-2, -1).contiguous(), wsf.transpose(-2, -1).contiguous()


def _wgrad(grad, x, offsets, recipe, backend, out_dtype):
    """dw[g] = grad_g.T @ x_g -> [G, N, K] in ``out_dtype`` (float32 accumulation written once in
    the weight's dtype: no float32 [G, N, K] buffer beside it)."""
    be = _plain_backend(backend)
    direct = out_dtype if out_dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    if recipe == "blockwise":
        dw = _gemm.k_grouped_gemm_tn(grad, x.to(grad.dtype), offsets, out_dtype=direct, backend=be)
    else:
        # the K-major group blocks the Triton k-grouped GEMM reads with TMA (no re-layout pass)
        ga = _gemm.quant_per_group_colwise(grad, offsets, layout="blocks", backend=be)
        xa = _gemm.quant_per_group_colwise(x, offsets, layout="blocks", backend=be)
        dw = _gemm.k_grouped_fp8_gemm_tn_contiguous(ga, xa, offsets, out_dtype=direct, backend=be)
    return dw.to(out_dtype)


# ------------------------------------------------------------------------------ dense


@torch.library.custom_op("primerl::fp8_linear_fwd", mutates_args=())
def _fp8_linear_fwd(x: torch.Tensor, weight: torch.Tensor, recipe: str, backend: Optional[str]) -> torch.Tensor:
    qb = _quant_backend(backend)
    a = quant_per_token_group(x, BLOCK, backend=qb)
    b = quant_per_block(weight, backend=qb)
    return _gemm.fp8_gemm_nt(a, b, out_dtype=_out_dtype(x), backend=backend)


@_fp8_linear_fwd.register_fake
def _(x, weight, recipe, backend):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=_out_dtype(x))


@torch.library.custom_op("primerl::fp8_linear_bwd", mutates_args=())
def _fp8_linear_bwd(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recipe: str, backend: Optional[str],
                    need_dx: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [M, K], dw [N, K]); a gradient that is not needed comes back as an empty tensor."""
    qb = _quant_backend(backend)
    dx, dw = x.new_zeros(0), weight.new_zeros(0)
    if need_dx:
        g = quant_per_token_group(grad, BLOCK, backend=qb)
        wt = _transposed_blocks(*quant_per_block(weight, backend=qb))
        dx = _gemm.fp8_gemm_nt(g, wt, out_dtype=x.dtype, backend=backend)
    if need_dw:
        offsets = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
        dw = _wgrad(grad, x, offsets, recipe, backend, weight.dtype)[0]
    return dx, dw


@_fp8_linear_bwd.register_fake
def _(grad, x, weight, recipe, backend, need_dx, need_dw):
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    dw = torch.empty_like(weight) if need_dw else weight.new_empty(0)
    return dx, dw


def _linear_setup(ctx, inputs, output):
    x, weight, recipe, backend = inputs
    ctx.save_for_backward(x, weight)
    ctx.recipe, ctx.backend = recipe, backend


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    # torch._grouped_mm (and our kernels) need a real strided gradient, not an expanded one
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = torch.ops.primerl.fp8_linear_bwd(grad.contiguous().to(x.dtype), x, weight, ctx.recipe, ctx.backend,
                                              need_dx, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None


_fp8_linear_fwd.register_autograd(_linear_backward, setup_context=_linear_setup)


def _check_recipe(op: str, recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"{op}: recipe must be one of {RECIPES}, got {recipe!r}")


def _check_dims(op: str, name: str, n: int, k: int) -> None:
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"{op}: {name} has out/in dims ({n}, {k}); FP8 blockwise training needs both to be "
                         f"multiples of {BLOCK}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               recipe: str = "blockwise", backend: str | None = None) -> torch.Tensor:
    """``y[..., N] = x[..., K] @ weight[N, K].T (+ bias)`` in FP8 with autograd (see module doc).

    N and K must be multiples of 128; any number of rows. Output dtype = x's dtype."""
    op = "fp8_linear"
    _check_recipe(op, recipe)
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: need x [..., K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    _check_dims(op, "weight", *weight.shape)
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)
                             or bias.device != x.device):
        raise ValueError(f"{op}: bias must be a tensor of shape [N] = ({weight.shape[0]},) on {x.device}, got "
                         f"{tuple(getattr(bias, 'shape', ()))} on {getattr(bias, 'device', type(bias).__name__)}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        y = x2 @ weight.to(x.dtype).t()
    elif recipe == "rowwise":
        from .fp8_rowwise import rowwise_linear

        y = rowwise_linear(x2.contiguous(), weight)
    else:
        y = _fp8_linear_fwd(x2.contiguous(), weight, recipe, backend)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


# ------------------------------------------------------------------------------ grouped


@torch.library.custom_op("primerl::fp8_grouped_linear_fwd", mutates_args=())
def _fp8_grouped_fwd(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, recipe: str,
                     backend: Optional[str]) -> torch.Tensor:
    qb = _quant_backend(backend)
    a = quant_per_token_group(x, BLOCK, backend=qb)
    b = quant_per_block(weight, backend=qb)
    return _gemm.m_grouped_fp8_gemm_nt_offsets(a, b, offsets, out_dtype=_out_dtype(x), backend=_plain_backend(backend))


@_fp8_grouped_fwd.register_fake
def _(x, weight, offsets, recipe, backend):
    return x.new_empty(x.shape[0], weight.shape[1], dtype=_out_dtype(x))


@torch.library.custom_op("primerl::fp8_grouped_linear_bwd", mutates_args=())
def _fp8_grouped_bwd(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, recipe: str,
                     backend: Optional[str], need_dx: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [M, K], dw [G, N, K]); a gradient that is not needed comes back as an empty tensor."""
    qb = _quant_backend(backend)
    dx, dw = x.new_zeros(0), weight.new_zeros(0)
    if need_dx:
        g = quant_per_token_group(grad, BLOCK, backend=qb)
        wt = _transposed_blocks(*quant_per_block(weight, backend=qb))
        dx = _gemm.m_grouped_fp8_gemm_nt_offsets(g, wt, offsets, out_dtype=x.dtype, backend=_plain_backend(backend))
    if need_dw:
        dw = _wgrad(grad, x, offsets, recipe, backend, weight.dtype)
    return dx, dw


@_fp8_grouped_bwd.register_fake
def _(grad, x, weight, offsets, recipe, backend, need_dx, need_dw):
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    dw = torch.empty_like(weight) if need_dw else weight.new_empty(0)
    return dx, dw


def _grouped_setup(ctx, inputs, output):
    x, weight, offsets, recipe, backend = inputs
    ctx.save_for_backward(x, weight, offsets)
    ctx.recipe, ctx.backend = recipe, backend


def _grouped_backward(ctx, grad):
    x, weight, offsets = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = torch.ops.primerl.fp8_grouped_linear_bwd(grad.contiguous().to(x.dtype), x, weight, offsets,
                                                      ctx.recipe, ctx.backend, need_dx, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None, None


_fp8_grouped_fwd.register_autograd(_grouped_backward, setup_context=_grouped_setup)


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
                       recipe: str = "blockwise", backend: str | None = None) -> torch.Tensor:
    """Grouped ``y[M, N]``: rows ``offsets[g-1]:offsets[g]`` of ``x[M, K]`` times ``weight[g].T``
    (``weight[G, N, K]``), in FP8 with autograd. Rows past ``offsets[-1]`` give zero output and
    zero gradient and are never read (NaN there is harmless). N, K multiples of 128."""
    op = "fp8_grouped_linear"
    _check_recipe(op, recipe)
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"{op}: need x [M, K] and weight [G, N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    _check_dims(op, "weight", weight.shape[1], weight.shape[2])
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() != weight.shape[0] \
            or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: offsets must be int32 [G={weight.shape[0]}] cumulative end rows, got "
                         f"{getattr(offsets, 'shape', type(offsets).__name__)}")
    if x.shape[0] == 0:
        return x.new_zeros(0, weight.shape[1]) + 0 * weight.sum().to(x.dtype)
    if recipe == "rowwise":
        from .fp8_rowwise import rowwise_grouped_linear

        return rowwise_grouped_linear(x.contiguous(), weight, offsets.to(torch.int32).contiguous())
    return _fp8_grouped_fwd(x.contiguous(), weight, offsets.to(torch.int32).contiguous(), recipe, backend)


# ------------------------------------------------------------------------------ module swap


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose forward runs :func:`fp8_linear`; made by :func:`convert_to_fp8`."""

    recipe: str = "blockwise"
    backend: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, recipe=self.recipe, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe!r}"


@dataclass
class Fp8ConversionReport:
    """What :func:`convert_to_fp8` did: ``converted`` the fqns switched to FP8 (``"<root>"`` for the
    model itself), ``kept`` the candidates left in high precision (exact ``nn.Linear`` and modules with
    ``enable_fp8``) mapped to why. Set as ``model.fp8_conversion`` and logged (logger ``primerl.fp8``)."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"convert_to_fp8({self.recipe!r}): {len(self.converted)} converted, {len(self.kept)} kept in "
                 "high precision"]
        lines += [f"  kept {fqn}: {why}" for fqn, why in self.kept.items()]
        return "\n".join(lines)


INCOMPATIBLE = ("skip", "raise")


def convert_to_fp8(model: nn.Module, recipe: str = "blockwise",
                   filter_fn: Callable[[str, nn.Module], bool] | None = None, *,
                   incompatible: str = "skip") -> nn.Module:
    """Switch ``model`` to FP8 training in place and return it; ``model.fp8_conversion`` holds the
    :class:`Fp8ConversionReport` (what was converted, what was kept and why).

    Every exact ``nn.Linear`` for which ``filter_fn(fqn, module)`` is true (all when None) becomes
    an :class:`Fp8Linear` with ``recipe``; every module exposing ``enable_fp8(recipe)`` (grouped
    experts) is asked to switch itself and is not descended into. A selected module whose dims are
    not multiples of 128 (the recipes' block) is kept in high precision and reported with
    ``incompatible="skip"`` (the default, as ``primerl.models.convert_to_fp8``), or, with
    ``incompatible="raise"``, raises ``ValueError`` naming it before anything changes (an
    ``enable_fp8`` module's own ValueError propagates). Convert before wrapping with FSDP / compile.
    """
    op = "convert_to_fp8"
    _check_recipe(op, recipe)
    if incompatible not in INCOMPATIBLE:
        raise ValueError(f"{op}: incompatible must be one of {INCOMPATIBLE}, got {incompatible!r}")
    report = Fp8ConversionReport(recipe)
    linears, grouped, owned = [], [], []
    for fqn, module in model.named_modules():
        if any(fqn.startswith(prefix + ".") or prefix == "" for prefix in owned):
            continue
        name = fqn or "<root>"
        has_enable = callable(getattr(module, "enable_fp8", None))
        if not has_enable and type(module) is not nn.Linear:
            continue
        if has_enable:
            owned.append(fqn)
        if filter_fn is not None and not filter_fn(fqn, module):
            report.kept[name] = "excluded by filter_fn"
            continue
        if has_enable:
            grouped.append((name, module))
        elif module.out_features % BLOCK or module.in_features % BLOCK:
            why = (f"nn.Linear(in_features={module.in_features}, out_features={module.out_features}): FP8 blockwise "
                   f"needs both to be multiples of {BLOCK}")
            if incompatible == "raise":
                raise ValueError(f"{op}: {name} is {why}. Exclude it with filter_fn or pass incompatible='skip'.")
            report.kept[name] = why
        else:
            linears.append((name, module))
    for name, module in grouped:
        try:
            module.enable_fp8(recipe)
        except ValueError as exc:
            if incompatible == "raise":
                raise
            report.kept[name] = f"enable_fp8 refused: {exc}"
            continue
        report.converted.append(name)
    for name, module in linears:
        module.__class__ = Fp8Linear
        module.recipe = recipe
        report.converted.append(name)
    object.__setattr__(model, "fp8_conversion", report)
    logging.getLogger("primerl.fp8").info("%s", report)
    return model
