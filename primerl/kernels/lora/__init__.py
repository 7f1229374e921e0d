"""LoRA ops: ``lora_linear`` (a frozen base GEMM plus the low-rank path) and ``grouped_lora`` (one
adapter per expert over m-grouped rows), forward and backward.

Legend: M rows (tokens), d input features, n output features, r rank, E experts.

* ``lora_linear(x, weight, lora_a, lora_b, scale)``: ``y[..., n] = x @ W.T + scale * (x @ A.T) @ B.T
  (+ bias)``; x ``[..., d]``, W ``[n, d]`` in x's dtype, or the GEMM layer's FP8 form ``(wq [n, d]
  float8_e4m3fn, wsf [n/128, d/128] float32)`` (:func:`primerl.kernels.fp8.quant_per_block`'s
  output: a frozen block-FP8 base), A ``[r, d]``, B ``[n, r]``. ``fp8_recipe=`` runs a 16/32-bit base
  through :func:`primerl.kernels.fp8_training.fp8_linear` (the base of an ``Fp8Linear``). Gradients
  flow to x, A, B (and to W / bias when they require grad; never to an FP8 W).
* ``grouped_lora(x, lora_a, lora_b, scale, offsets=... | m_indices=...)``: the delta ``[M, n]``,
  **scale included**: rows of expert e get ``scale * (x_e @ A[e].T) @ B[e].T``; x ``[M, d]`` grouped
  as the grouped GEMMs take it (:mod:`primerl.kernels.gemm.offsets`): ``offsets[E]`` cumulative end
  rows (rows past ``offsets[-1]`` give zero) or ``m_indices[M]`` (-1 = padding row, zero); A ``[E,
  r, d]``, B ``[E, n, r]``. Gradients to x, A, B.

Backends: ``"torch"`` (:mod:`.reference`, autograd through torch) and ``"triton"``; ``backend=None``
takes torch on CPU tensors and Triton on CUDA.

>>> import torch
>>> from primerl.kernels.lora import lora_linear, grouped_lora
>>> x, w = torch.randn(4, 32), torch.randn(48, 32)
>>> a, b = torch.randn(8, 32), torch.randn(48, 8)
>>> y = lora_linear(x, w, a, b, 0.5)                                       # [4, 48]
>>> offs = torch.tensor([1, 4], dtype=torch.int32)
>>> d = grouped_lora(x, torch.randn(2, 8, 32), torch.randn(2, 48, 8), 0.5, offsets=offs)   # [4, 48]
"""

from __future__ import annotations

import numbers

import torch

from .._backend import resolve_backend
from ..gemm._checks import _check_index, _check_m_indices_content, _check_offsets_content, _check_same_device
from . import reference

__all__ = ["lora_linear", "grouped_lora", "BACKENDS"]

BACKENDS = ("torch", "triton")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_BLOCK = 128  # the FP8 block, and the row block of the m_indices layout Triton takes


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_tensor(op: str, name: str, t, dims: int | None, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{op}: {name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} dtype must be one of {dtypes}, got {t.dtype}")


def _check_scale(op: str, scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{op}: scale must be a Python float (alpha / rank), got {type(scale).__name__} {scale!r}")
    return float(scale)


def _check_lora_pair(op: str, x: torch.Tensor, lora_a, lora_b, grouped: bool) -> tuple[int, int]:
    """A [(E,) r, d], B [(E,) n, r] in x's dtype; returns (r, n)."""
    dims = 3 if grouped else 2
    shape_a, shape_b = ("[E, r, d]", "[E, n, r]") if grouped else ("[r, d]", "[n, r]")
    _check_tensor(op, "lora_a", lora_a, dims, (x.dtype,))
    _check_tensor(op, "lora_b", lora_b, dims, (x.dtype,))
    d = x.shape[-1]
    r = lora_a.shape[-2]
    if r < 1:
        raise ValueError(f"{op}: lora_a {shape_a} must have rank r >= 1, got shape {tuple(lora_a.shape)}")
    if lora_a.shape[-1] != d:
        raise ValueError(f"{op}: lora_a {shape_a} must have d = {d} (x's last dim), got shape {tuple(lora_a.shape)}")
    if lora_b.shape[-1] != r:
        raise ValueError(f"{op}: lora_b {shape_b} must have r = {r} (lora_a's rank), got shape {tuple(lora_b.shape)}")
    if grouped and lora_b.shape[0] != lora_a.shape[0]:
        raise ValueError(f"{op}: lora_a and lora_b must have the same experts E, got {tuple(lora_a.shape)} and "
                         f"{tuple(lora_b.shape)}")
    return r, lora_b.shape[-2]


def _resolve(op: str, backend, device: torch.device, dtype: torch.dtype) -> str:
    be = resolve_backend(op, backend, device, supported=BACKENDS, preference=("triton", "torch"))
    if be == "triton" and dtype not in _TRITON_DTYPES:
        if backend is None:
            return "torch"  # float64 (a test's reference precision) has no tensor-core kernel: the reference
        raise ValueError(f"{op}: the triton backend takes {_TRITON_DTYPES}, got {dtype}; use backend='torch'")
    return be


# ------------------------------------------------------------------------------ lora_linear


def _check_weight(op: str, x: torch.Tensor, weight, fp8_recipe) -> tuple[int, bool]:
    """weight [n, d] in x's dtype, or (wq [n, d] fp8, wsf [n/128, d/128] float32); returns (n, is_fp8)."""
    d = x.shape[-1]
    if isinstance(weight, (tuple, list)):
        if len(weight) != 2:
            raise TypeError(f"{op}: an FP8 weight is a pair (wq [n, d], wsf [n/128, d/128]), got {len(weight)} items")
        wq, wsf = weight
        _check_tensor(op, "weight[0] (wq)", wq, 2, _FP8_WEIGHT_DTYPES)
        _check_tensor(op, "weight[1] (wsf)", wsf, 2, (torch.float32,))
        n = wq.shape[0]
        if wq.shape[1] != d:
            raise ValueError(f"{op}: weight[0] (wq) must be [n, d] with d = {d} (x's last dim), got {tuple(wq.shape)}")
        if n % FP8_BLOCK or d % FP8_BLOCK:
            raise ValueError(f"{op}: an FP8 weight needs n and d multiples of {FP8_BLOCK} (128x128 blocks), "
                             f"got wq {tuple(wq.shape)}")
        want = (n // FP8_BLOCK, d // FP8_BLOCK)
        if tuple(wsf.shape) != want:
            raise ValueError(f"{op}: weight[1] (wsf) must be the 128x128 block scales {want} of wq "
                             f"{tuple(wq.shape)} (quant_per_block), got {tuple(wsf.shape)}")
        if fp8_recipe is not None:
            raise ValueError(f"{op}: fp8_recipe={fp8_recipe!r} is for a 16/32-bit weight; this weight is already FP8")
        return n, True
    _check_tensor(op, "weight", weight, 2, (x.dtype,))
    if weight.shape[1] != d:
        raise ValueError(f"{op}: weight must be [n, d] with d = {d} (x's last dim), got {tuple(weight.shape)}")
    if fp8_recipe is not None:
        from ..fp8_training import RECIPES

        if fp8_recipe not in RECIPES:
            raise ValueError(f"{op}: fp8_recipe must be None or one of {RECIPES}, got {fp8_recipe!r}")
    return weight.shape[0], False


def lora_linear(x: torch.Tensor, weight, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, *,
                bias: torch.Tensor | None = None, fp8_recipe: str | None = None,
                backend: str | None = None) -> torch.Tensor:
    """``y[..., n] = x @ W.T + scale * (x @ A.T) @ B.T (+ bias)``; differentiable (see module doc).

    x ``[..., d]`` bf16/fp16/fp32 (float64 on the torch backend); weight ``[n, d]`` in x's dtype or
    ``(wq, wsf)`` block FP8 (n, d multiples of 128); lora_a ``[r, d]``, lora_b ``[n, r]`` in x's
    dtype; scale a float (PEFT's ``lora_alpha / r``); bias ``[n]`` or None; fp8_recipe: None, or a recipe of
    :mod:`primerl.kernels.fp8_training` to run a 16/32-bit base in FP8. Output in x's dtype."""
    op = "lora_linear"
    _check_tensor(op, "x", x, None, _DTYPES)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must be [..., d], got a 0-dim tensor")
    n, is_fp8 = _check_weight(op, x, weight, fp8_recipe)
    r, n_b = _check_lora_pair(op, x, lora_a, lora_b, grouped=False)
    if n_b != n:
        raise ValueError(f"{op}: lora_b must be [n, r] with n = {n} (the weight's rows), got {tuple(lora_b.shape)}")
    scale = _check_scale(op, scale)
    if bias is not None:
        _check_tensor(op, "bias", bias, 1, (x.dtype,))
        if bias.shape[0] != n:
            raise ValueError(f"{op}: bias must be [n] = ({n},), got {tuple(bias.shape)}")
    tensors = dict(x=x, lora_a=lora_a, lora_b=lora_b, bias=bias)
    tensors.update(dict(wq=weight[0], wsf=weight[1]) if is_fp8 else dict(weight=weight))
    dev = _check_same_device(op, **tensors)
    be = _resolve(op, backend, dev, x.dtype)
    x2 = x.reshape(-1, x.shape[-1])
    if is_fp8:
        from .fp8_base import fp8_base

        # the base GEMM picks its own fastest backend when none was named (cuBLAS / DeepGEMM on CUDA)
        base = fp8_base(x2, weight[0], weight[1], backend)
    elif fp8_recipe is not None:
        from ..fp8_training import fp8_linear

        base = fp8_linear(x2, weight, recipe=fp8_recipe, backend=backend)
    else:
        base = None
    if be == "triton":
        from . import triton_ops

        y = triton_ops.lora_linear(x2, None if base is not None else weight, lora_a, lora_b, scale, base)
    elif base is None:
        y = reference.lora_linear(x2, weight, lora_a, lora_b, scale)
    else:
        y = base + reference.lora_delta(x2, lora_a, lora_b, scale)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


# ------------------------------------------------------------------------------ grouped_lora


def grouped_lora(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, *,
                 offsets: torch.Tensor | None = None, m_indices: torch.Tensor | None = None,
                 backend: str | None = None) -> torch.Tensor:
    """Per-expert LoRA delta ``[M, n]`` (scale included) over m-grouped rows; differentiable.

    x ``[M, d]``; lora_a ``[E, r, d]``, lora_b ``[E, n, r]`` in x's dtype; exactly one of
    ``offsets[E]`` (int32 cumulative end rows, non-decreasing, ``offsets[-1] <= M``: rows past it give
    zero and are never read) or ``m_indices[M]`` (int32 expert of each row, -1 = padding: zero; the
    Triton backend takes the aligned contiguous layout of
    :func:`primerl.kernels.gemm.pad_to_contiguous`, any order on torch)."""
    op = "grouped_lora"
    _check_tensor(op, "x", x, 2, _DTYPES)
    r, n = _check_lora_pair(op, x, lora_a, lora_b, grouped=True)
    num_experts = lora_a.shape[0]
    if num_experts < 1:
        raise ValueError(f"{op}: lora_a must hold at least one expert, got shape {tuple(lora_a.shape)}")
    scale = _check_scale(op, scale)
    if (offsets is None) == (m_indices is None):
        raise ValueError(f"{op}: pass exactly one of offsets= (cumulative end rows [E]) or m_indices= (expert of "
                         f"each row [M])")
    if offsets is not None:
        index, kind = _check_index(op, "offsets", offsets, num_experts), "offsets"
        _check_offsets_content(op, index, x.shape[0])
    else:
        index, kind = _check_index(op, "m_indices", m_indices, x.shape[0]), "m_indices"
        _check_m_indices_content(op, index, num_experts, one_group_per_block=False)
    dev = _check_same_device(op, x=x, lora_a=lora_a, lora_b=lora_b, **{kind: index})
    be = _resolve(op, backend, dev, x.dtype)
    if be == "triton":
        from . import triton_ops

        if kind == "m_indices":
            if x.shape[0] % FP8_BLOCK:
                raise ValueError(f"{op}: the triton backend takes m_indices only in the aligned contiguous layout "
                                 f"(M a multiple of {FP8_BLOCK}, see pad_to_contiguous), got M={x.shape[0]}")
            _check_m_indices_content(op, index, num_experts, ascending=True)
        return triton_ops.grouped_lora(x, lora_a, lora_b, scale, index, kind)
    return reference.grouped_lora(x, lora_a, lora_b, scale, index, kind)
