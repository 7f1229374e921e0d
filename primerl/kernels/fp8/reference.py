"""Plain-PyTorch FP8 quantization: the definition of what every backend computes.

Convention (DeepGEMM's): ``sf`` is the dequantization factor, ``x ≈ q.float() * sf``.
Per group: ``amax = max(|x|)`` in float32, clamped to >= 1e-4; ``sf = amax / fmax`` (448 for
e4m3, 57344 for e5m2); with ``ue8m0`` sf is rounded up to a power of two; ``q = x / sf`` clamped
to ±fmax and cast (division, not multiplication by a reciprocal: the bits differ).
"""

from __future__ import annotations

import torch

AMAX_FLOOR = 1e-4


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def round_scale_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(sf)) for positive normal float32 sf, done on the bits (log2 is inexact)."""
    bits = sf.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, ue8m0: bool) -> torch.Tensor:
    amax = amax.float().clamp_min(AMAX_FLOOR)
    # Divide by a tensor, not a Python scalar: on CUDA torch turns `t / scalar` into
    # `t * (1 / scalar)`, whose bits differ from the IEEE quotient the kernels compute.
    sf = amax / torch.full_like(amax, fp8_max(dtype))
    return round_scale_ue8m0(sf) if ue8m0 else sf


def cast_scaled(x: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = fp8_max(dtype)
    return (x.float() / sf).clamp(-fmax, fmax).to(dtype)


def quant_per_token_group(x: torch.Tensor, group_size: int, dtype: torch.dtype, ue8m0: bool):
    """x [..., K] -> q [..., K] fp8, sf [..., K // group_size] float32."""
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    sf = scale_from_amax(groups.abs().amax(dim=-1).float(), dtype, ue8m0)
    q = cast_scaled(groups, sf.unsqueeze(-1), dtype)
    return q.reshape(x.shape), sf


def quant_per_block(w: torch.Tensor, block_size: tuple[int, int], dtype: torch.dtype, ue8m0: bool):
    """w [(G,) N, K] -> q like w, sf [(G,) ceil(N/bn), ceil(K/bk)]; ragged edge blocks allowed."""
    bn, bk = block_size
    n, k = w.shape[-2:]
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(*w.shape[:-2], nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.float()
    blocks = padded.reshape(*w.shape[:-2], nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1))
    sf = scale_from_amax(amax, dtype, ue8m0)
    q = cast_scaled(blocks, sf[..., :, None, :, None], dtype)
    q = q.reshape(*w.shape[:-2], nb * bn, kb * bk)[..., :n, :k].contiguous()
    return q, sf


def quant_rowwise(x: torch.Tensor, dtype: torch.dtype):
    """x [..., K] -> q, sf [..., 1]."""
    sf = scale_from_amax(x.abs().amax(dim=-1, keepdim=True).float(), dtype, False)
    return cast_scaled(x, sf, dtype), sf


def quant_tensorwise(x: torch.Tensor, dtype: torch.dtype):
    """x -> q, sf [] (0-dim float32)."""
    sf = scale_from_amax(x.abs().amax().float(), dtype, False)
    return cast_scaled(x, sf, dtype), sf


def expand_scales(sf: torch.Tensor, shape: torch.Size, group_shape: tuple[int, ...]) -> torch.Tensor:
    """Broadcast per-group scales to the full ``shape`` (group_shape covers the trailing dims)."""
    ndim = len(shape)
    sf = sf.float()
    if sf.dim() < ndim:
        sf = sf.reshape((1,) * (ndim - sf.dim()) + tuple(sf.shape))
    lead = ndim - len(group_shape)
    for i, g in enumerate(group_shape):
        dim = lead + i
        if sf.shape[dim] != 1:
            sf = sf.repeat_interleave(g, dim=dim).narrow(dim, 0, shape[dim])
    return sf


def dequant(q: torch.Tensor, sf: torch.Tensor, group_shape: tuple[int, ...], out_dtype: torch.dtype):
    return (q.float() * expand_scales(sf, q.shape, group_shape)).to(out_dtype)
