"""FP8 quantization in the layouts DeepGEMM, DeepEP and vLLM use.

Convention: ``x ≈ q.float() * sf`` (sf is the dequantization factor, float32). The exact
arithmetic, the ``rounding`` choice (``"reciprocal"``: ``x * (1 / sf)`` as DeepGEMM / DeepEP,
``"divide"``: ``x / sf`` as vLLM / SGLang) and the NaN / inf policy are defined in
:mod:`primerl.kernels.fp8.reference`; every backend is bitwise equal to it. The DeepGEMM-layout
ops (per token group, per block) default to ``"reciprocal"``, the ``torch._scaled_mm`` layouts
(rowwise, tensorwise) to ``"divide"``.

>>> import torch
>>> from primerl.kernels.fp8 import quant_per_token_group, dequant
>>> x = torch.randn(4, 256)
>>> q, sf = quant_per_token_group(x, 128)          # q [4, 256] float8_e4m3fn, sf [4, 2]
>>> x_hat = dequant(q, sf, group_shape=(1, 128), out_dtype=torch.float32)
"""

from __future__ import annotations

import torch

from .._args import check_int
from .._backend import resolve_backend
from . import reference
from .reference import ROUNDINGS

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

__all__ = [
    "FP8_DTYPES",
    "ROUNDINGS",
    "quant_per_token_group",
    "quant_per_block",
    "quant_rowwise",
    "quant_tensorwise",
    "dequant",
]


def _check_rounding(op: str, rounding) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"{op}: rounding must be one of {ROUNDINGS}, got {rounding!r}")


def _check_input(op: str, x: torch.Tensor, dtype: torch.dtype, min_dim: int, max_dim: int | None = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{op}: input dtype must be one of {_INPUT_DTYPES}, got {x.dtype}")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{op}: dtype must be one of {FP8_DTYPES}, got {dtype}")
    if x.dim() < min_dim or (max_dim is not None and x.dim() > max_dim):
        want = f"{min_dim}" if max_dim == min_dim else f"{min_dim}..{max_dim or 'any'}"
        raise ValueError(f"{op}: input must have {want} dims, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{op}: input is empty (shape {tuple(x.shape)})")


def _impl(backend: str):
    if backend == "triton":
        from .._opaque import launching_directly

        if launching_directly():
            from . import triton as impl
        else:
            from . import triton_ops as impl  # the Triton launchers as custom ops (traceable)
    elif backend == "cuda":
        from . import cuda as impl
    else:
        impl = reference
    return impl


def quant_per_token_group(
    x: torch.Tensor,
    group_size: int = 128,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    ue8m0: bool = False,
    rounding: str = "reciprocal",
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each run of ``group_size`` elements along the last dim (1 x group_size scales).

    x ``[..., K]`` (float32/bf16/fp16) -> q ``[..., K]`` fp8, sf ``[..., K // group_size]`` float32.
    ``rounding="reciprocal"`` (default) is bitwise DeepGEMM's ``per_token_cast_to_fp8``.
    """
    op = "quant_per_token_group"
    _check_input(op, x, dtype, 1)
    check_int(op, "group_size", group_size)
    _check_rounding(op, rounding)
    if group_size <= 0 or x.shape[-1] % group_size != 0:
        raise ValueError(f"{op}: K={x.shape[-1]} (last dim) must be divisible by group_size={group_size}")
    be = resolve_backend(op, backend, x.device)
    return _impl(be).quant_per_token_group(x.contiguous(), group_size, dtype, ue8m0, rounding)


def quant_per_block(
    w: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    ue8m0: bool = False,
    rounding: str = "reciprocal",
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``block_size`` tiles of a weight (ragged edge tiles allowed).

    w ``[N, K]`` or ``[G, N, K]`` -> q like w, sf ``[(G,) ceil(N/bn), ceil(K/bk)]`` float32.
    ``rounding="reciprocal"`` (default) is bitwise DeepGEMM's ``per_block_cast_to_fp8``.
    """
    op = "quant_per_block"
    _check_input(op, w, dtype, 2, 3)
    _check_rounding(op, rounding)
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
        raise TypeError(f"{op}: block_size must be a pair of ints, got {block_size!r}")
    for v in block_size:
        check_int(op, "block_size", v)
    if min(block_size) <= 0:
        raise ValueError(f"{op}: block_size must be two positive ints, got {block_size}")
    be = resolve_backend(op, backend, w.device)
    return _impl(be).quant_per_block(w.contiguous(), tuple(block_size), dtype, ue8m0, rounding)


def quant_rowwise(
    x: torch.Tensor, *, dtype: torch.dtype = torch.float8_e4m3fn, rounding: str = "divide",
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row: x ``[..., K]`` -> q, sf ``[..., 1]`` (torch._scaled_mm's rowwise layout)."""
    op = "quant_rowwise"
    _check_input(op, x, dtype, 1)
    _check_rounding(op, rounding)
    be = resolve_backend(op, backend, x.device)
    return _impl(be).quant_rowwise(x.contiguous(), dtype, rounding)


def quant_tensorwise(
    x: torch.Tensor, *, dtype: torch.dtype = torch.float8_e4m3fn, rounding: str = "divide",
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor: x -> q, sf ``[]`` (0-dim float32)."""
    op = "quant_tensorwise"
    _check_input(op, x, dtype, 0)
    _check_rounding(op, rounding)
    be = resolve_backend(op, backend, x.device)
    return _impl(be).quant_tensorwise(x.contiguous(), dtype, rounding)


def dequant(
    q: torch.Tensor,
    sf: torch.Tensor,
    *,
    group_shape: tuple[int, ...],
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of every quantizer: ``q.float() * sf`` with sf broadcast over its groups.

    ``group_shape`` gives the group size of each trailing dim: ``(1, 128)`` per token group,
    ``(128, 128)`` per block, ``(1, K)`` rowwise, ``tuple(q.shape)`` tensorwise.
    """
    if q.dtype not in FP8_DTYPES:
        raise ValueError(f"dequant: q must be fp8 ({FP8_DTYPES}), got {q.dtype}")
    if sf.dtype != torch.float32:
        raise ValueError(f"dequant: sf must be float32, got {sf.dtype}")
    if len(group_shape) > q.dim() or any(g <= 0 for g in group_shape):
        raise ValueError(f"dequant: group_shape {group_shape} does not fit q of shape {tuple(q.shape)}")
    if sf.dim() > 0:
        lead = q.dim() - len(group_shape)
        for i, g in enumerate(group_shape):
            d = lead + i
            want = -(-q.shape[d] // g)
            have = sf.shape[d - (q.dim() - sf.dim())] if d - (q.dim() - sf.dim()) >= 0 else 1
            if have not in (want, 1):
                raise ValueError(
                    f"dequant: sf has {have} groups on dim {d}, expected ceil({q.shape[d]}/{g}) = {want}"
                )
    return reference.dequant(q, sf, tuple(group_shape), out_dtype)
