"""Plain-PyTorch FP8 quantization: the definition of what every backend computes.

Convention (DeepGEMM's): ``sf`` is the dequantization factor, ``x ≈ q.float() * sf``.
Per group, in float32:

* ``amax = max(|x|)``, clamped to >= 1e-4 (``AMAX_FLOOR``);
* ``sf = amax / fmax`` (IEEE division; 448 for e4m3, 57344 for e5m2); with ``ue8m0`` sf is
  rounded up to a power of two on its bits, the exponent clamped to [1, 254] (DeepGEMM's
  ``ceil_to_ue8m0``);
* ``q = cast(clamp(x * (1 / sf), -fmax, fmax))`` with ``rounding="reciprocal"`` (DeepGEMM's
  test helpers, DeepEP) or ``cast(clamp(x / sf, -fmax, fmax))`` with ``rounding="divide"``
  (vLLM's and SGLang's quantizers). The two differ in the last bit of the quotient for a few
  elements per million (about 3e-7 of the bytes from float32 input, 5e-4 from bf16), and never
  when sf is a power of two (ue8m0). ``1 / sf`` is the IEEE-rounded reciprocal.

NaN / inf policy (identical on every backend, tested):

* a NaN anywhere in a group makes its amax NaN (``torch.amax`` semantics; a kernel must not use
  a max that drops NaN); so does +-inf make it inf;
* without ue8m0, sf is then NaN (resp. inf); with ue8m0 both become ``2**127`` (exponent 254);
* q keeps NaN as NaN (the clamp does not turn it into +-fmax) and saturates +-inf to +-fmax. So
  without ue8m0 a group holding NaN quantizes to all-NaN q, and one holding inf to zeros with NaN
  at the inf elements (inf / inf); with ue8m0 (sf = 2**127) only the NaN elements are NaN, inf
  elements give +-fmax and the rest 0. The sign of a NaN byte in q is not specified (a GPU writes
  0x7F, torch on CPU keeps the NaN's sign): compare NaN positions, not NaN bytes.

Note: DeepGEMM's ``per_token_cast_to_fp8`` run on a CUDA tensor computes ``amax / 448.0`` as
``amax * (1 / 448.0)`` (torch's CUDA kernel multiplies by the reciprocal of a scalar divisor), so
its non-ue8m0 scales differ in the last bit from this definition there; on CPU they are equal.
"""

from __future__ import annotations

import torch

AMAX_FLOOR = 1e-4
ROUNDINGS = ("reciprocal", "divide")
UE8M0_MIN_EXPONENT, UE8M0_MAX_EXPONENT = 1, 254


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def round_scale_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(|sf|)) for float32 sf, on the bits (log2 is inexact); the biased exponent is
    clamped to [1, 254], so 0 / subnormals give 2**-126 and inf / NaN give 2**127."""
    bits = sf.view(torch.int32) & 0x7FFFFFFF
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent.clamp(UE8M0_MIN_EXPONENT, UE8M0_MAX_EXPONENT) << 23).view(torch.float32)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, ue8m0: bool) -> torch.Tensor:
    amax = amax.float().clamp_min(AMAX_FLOOR)  # NaN stays NaN
    # Divide by a tensor, not a Python scalar: on CUDA torch turns `t / scalar` into
    # `t * (1 / scalar)`, whose bits differ from the IEEE quotient the kernels compute.
    sf = amax / torch.full_like(amax, fp8_max(dtype))
    return round_scale_ue8m0(sf) if ue8m0 else sf


def cast_operand(sf: torch.Tensor, rounding: str) -> torch.Tensor:
    """What :func:`cast_with` takes: ``1 / sf`` (IEEE) for ``"reciprocal"``, else sf itself. Take
    it before expanding sf to the elements: one reciprocal per group, not per element."""
    return torch.reciprocal(sf) if rounding == "reciprocal" else sf


def cast_with(x: torch.Tensor, operand: torch.Tensor, dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """``cast(clamp(x * operand))`` (reciprocal) or ``cast(clamp(x / operand))`` in float32."""
    if x.dtype != torch.float32 and operand.dim() == 0:
        x = x.float()  # a 0-dim float32 operand would not promote a bf16 / fp16 x to float32
    # a bf16 / fp16 x against a float32 operand computes in float32 (exact upcast): no x.float() copy
    y = x * operand if rounding == "reciprocal" else x / operand
    fmax = fp8_max(dtype)
    return y.clamp_(-fmax, fmax).to(dtype)


def cast_scaled(x: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype, rounding: str = "divide") -> torch.Tensor:
    """``cast(clamp(x / sf))`` or, with ``rounding="reciprocal"``, ``cast(clamp(x * (1 / sf)))``
    in float32; the clamp keeps NaN (torch.clamp semantics)."""
    return cast_with(x, cast_operand(sf, rounding), dtype, rounding)


def quant_per_token_group(x: torch.Tensor, group_size: int, dtype: torch.dtype, ue8m0: bool,
                          rounding: str = "reciprocal"):
    """x [..., K] -> q [..., K] fp8, sf [..., K // group_size] float32."""
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    sf = scale_from_amax(groups.abs().amax(dim=-1).float(), dtype, ue8m0)
    q = cast_scaled(groups, sf.unsqueeze(-1), dtype, rounding)
    return q.reshape(x.shape), sf


def quant_per_block(w: torch.Tensor, block_size: tuple[int, int], dtype: torch.dtype, ue8m0: bool,
                    rounding: str = "reciprocal"):
    """w [(G,) N, K] -> q like w, sf [(G,) ceil(N/bn), ceil(K/bk)]; ragged edge blocks allowed."""
    bn, bk = block_size
    n, k = w.shape[-2:]
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(*w.shape[:-2], nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.float()
    blocks = padded.reshape(*w.shape[:-2], nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1))
    sf = scale_from_amax(amax, dtype, ue8m0)
    q = cast_scaled(blocks, sf[..., :, None, :, None], dtype, rounding)
    q = q.reshape(*w.shape[:-2], nb * bn, kb * bk)[..., :n, :k].contiguous()
    return q, sf


def quant_rowwise(x: torch.Tensor, dtype: torch.dtype, rounding: str = "divide"):
    """x [..., K] -> q, sf [..., 1]."""
    sf = scale_from_amax(x.abs().amax(dim=-1, keepdim=True).float(), dtype, False)
    return cast_scaled(x, sf, dtype, rounding), sf


def quant_tensorwise(x: torch.Tensor, dtype: torch.dtype, rounding: str = "divide"):
    """x -> q, sf [] (0-dim float32)."""
    sf = scale_from_amax(x.abs().amax().float(), dtype, False)
    return cast_scaled(x, sf, dtype, rounding), sf


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
