"""CUDA FP8 quantization: thin calls into ``torch.ops.primerl.fp8_quant_*`` (csrc/fp8/quant.cu).

The ops' schemas and fake kernels are defined in :mod:`primerl.kernels._ext`, their CUDA kernels by
the extension ``primerl._C``: each call is one opaque node under torch.compile / FakeTensorMode,
with or without the extension (without it a call on CUDA tensors raises an error naming it). The
public functions in :mod:`primerl.kernels.fp8` validate inputs and only route here when that
extension and a CUDA device are available (or when told to, to trace).
"""

from __future__ import annotations

import torch

from .. import _ext  # noqa: F401  (defines torch.ops.primerl.fp8_quant_*)


def quant_per_token_group(x: torch.Tensor, group_size: int, dtype: torch.dtype, ue8m0: bool,
                          rounding: str = "reciprocal"):
    """x [..., K] contiguous CUDA -> q [..., K] fp8, sf [..., K // group_size] float32."""
    return torch.ops.primerl.fp8_quant_per_token_group(x, group_size, dtype, ue8m0, rounding == "reciprocal")


def quant_per_block(w: torch.Tensor, block_size: tuple[int, int], dtype: torch.dtype, ue8m0: bool,
                    rounding: str = "reciprocal"):
    """w [(G,) N, K] contiguous CUDA -> q like w, sf [(G,) ceil(N/bn), ceil(K/bk)] float32."""
    return torch.ops.primerl.fp8_quant_per_block(w, block_size[0], block_size[1], dtype, ue8m0,
                                                 rounding == "reciprocal")


def quant_rowwise(x: torch.Tensor, dtype: torch.dtype, rounding: str = "divide"):
    """x [..., K] contiguous CUDA -> q [..., K] fp8, sf [..., 1] float32."""
    return torch.ops.primerl.fp8_quant_rowwise(x, dtype, rounding == "reciprocal")


def quant_tensorwise(x: torch.Tensor, dtype: torch.dtype, rounding: str = "divide"):
    """x contiguous CUDA -> q like x, sf [] float32."""
    return torch.ops.primerl.fp8_quant_tensorwise(x, dtype, rounding == "reciprocal")
