"""The FP8 quantizers' Triton launchers (:mod:`.triton`) as ``torch.library`` custom ops, so
torch.compile and FakeTensorMode see one node with a fake kernel (the shapes of :mod:`.reference`)
instead of tracing into a Triton launch. ``backend="triton"`` in :mod:`primerl.kernels.fp8` runs
through this module; the quantizers are not differentiable (no autograd to register)."""

from __future__ import annotations

import torch

from . import triton as T


@torch.library.custom_op("primerl::fp8_quant_per_token_group_triton", mutates_args=())
def _per_token_group(x: torch.Tensor, group_size: int, dtype: torch.dtype, ue8m0: bool,
                     rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    return T.quant_per_token_group(x, group_size, dtype, ue8m0, rounding)


@_per_token_group.register_fake
def _(x, group_size, dtype, ue8m0, rounding):
    return (x.new_empty(x.shape, dtype=dtype),
            x.new_empty(*x.shape[:-1], x.shape[-1] // group_size, dtype=torch.float32))


@torch.library.custom_op("primerl::fp8_quant_per_block_triton", mutates_args=())
def _per_block(w: torch.Tensor, block_n: int, block_k: int, dtype: torch.dtype, ue8m0: bool,
               rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    return T.quant_per_block(w, (block_n, block_k), dtype, ue8m0, rounding)


@_per_block.register_fake
def _(w, block_n, block_k, dtype, ue8m0, rounding):
    n, k = w.shape[-2:]
    return (w.new_empty(w.shape, dtype=dtype),
            w.new_empty(*w.shape[:-2], -(-n // block_n), -(-k // block_k), dtype=torch.float32))


@torch.library.custom_op("primerl::fp8_quant_rowwise_triton", mutates_args=())
def _rowwise(x: torch.Tensor, dtype: torch.dtype, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    return T.quant_rowwise(x, dtype, rounding)


@_rowwise.register_fake
def _(x, dtype, rounding):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


@torch.library.custom_op("primerl::fp8_quant_tensorwise_triton", mutates_args=())
def _tensorwise(x: torch.Tensor, dtype: torch.dtype, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    return T.quant_tensorwise(x, dtype, rounding)


@_tensorwise.register_fake
def _(x, dtype, rounding):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((), dtype=torch.float32)


def quant_per_token_group(x, group_size, dtype, ue8m0, rounding="reciprocal"):
    return _per_token_group(x, group_size, dtype, ue8m0, rounding)


def quant_per_block(w, block_size, dtype, ue8m0, rounding="reciprocal"):
    return _per_block(w, block_size[0], block_size[1], dtype, ue8m0, rounding)


def quant_rowwise(x, dtype, rounding="divide"):
    return _rowwise(x, dtype, rounding)


def quant_tensorwise(x, dtype, rounding="divide"):
    return _tensorwise(x, dtype, rounding)
