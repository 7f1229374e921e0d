"""Adapter to DeepGEMM (Hopper; built from source by the user, the PyPI ``deep-gemm`` is a placeholder).

DeepGEMM wants the A-side scales MN-major and TMA-aligned: ``sf[(G,) M, K/128]`` stored with
the M dim contiguous and padded to a multiple of 16 bytes (4 float32), i.e. strides
``(.., 1, M_aligned)``. Our quantizers emit K-major scales, so the adapter converts them here
(pure torch: tested on CPU). B-side 128x128 block scales are passed as they are (K-major fp32).
Both DeepGEMM API generations are handled: ``fp8_gemm_nt`` & co (v2) and
``gemm_fp8_fp8_bf16_nt`` & co (v1). DeepGEMM writes bf16 output only.
"""

from __future__ import annotations

import importlib

import torch

TMA_ALIGNMENT_BYTES = 16


def tma_aligned_size(mn: int, element_size: int) -> int:
    """Round ``mn`` up so that a row of ``mn`` elements is a multiple of 16 bytes."""
    align = TMA_ALIGNMENT_BYTES // element_size
    return -(-mn // align) * align


def to_mn_major_tma_aligned(sf: torch.Tensor) -> torch.Tensor:
    """``sf[(G,) MN, SK]`` (any layout) -> the same values, stored MN-major with MN padded to the
    TMA alignment: strides ``(MN_aligned * SK, 1, MN_aligned)``; the padding is zero."""
    if sf.dim() not in (2, 3) or sf.dtype != torch.float32:
        raise ValueError(f"to_mn_major_tma_aligned: sf must be 2-D/3-D float32, got {tuple(sf.shape)} {sf.dtype}")
    mn, sk = sf.shape[-2:]
    aligned = tma_aligned_size(mn, sf.element_size())
    buf = sf.new_zeros(*sf.shape[:-2], sk, aligned)
    buf[..., :mn] = sf.transpose(-1, -2)
    return buf.transpose(-1, -2)[..., :mn, :]


def is_mn_major_tma_aligned(sf: torch.Tensor) -> bool:
    mn = sf.shape[-2]
    aligned = tma_aligned_size(mn, sf.element_size())
    ok = sf.stride(-2) == 1 and (sf.shape[-1] == 1 or sf.stride(-1) == aligned)
    if sf.dim() == 3:
        ok = ok and sf.stride(0) == aligned * sf.shape[-1]
    return ok


def _module():
    return importlib.import_module("deep_gemm")


def _call(new_name: str, old_name: str, *args):
    dg = _module()
    fn = getattr(dg, new_name, None) or getattr(dg, old_name, None)
    if fn is None:
        raise RuntimeError(f"deep_gemm has neither {new_name} nor {old_name}; unsupported DeepGEMM version")
    return fn(*args)


def _bf16_only(op: str, out_dtype: torch.dtype) -> None:
    if out_dtype != torch.bfloat16:
        raise ValueError(f"{op}: the deep_gemm backend writes bf16 only, got out_dtype={out_dtype}")


def fp8_gemm_nt(a, b, out_dtype):
    _bf16_only("fp8_gemm_nt", out_dtype)
    (aq, asf), (bq, bsf) = a, b
    d = torch.empty(aq.shape[0], bq.shape[0], dtype=torch.bfloat16, device=aq.device)
    _call("fp8_gemm_nt", "gemm_fp8_fp8_bf16_nt", (aq, to_mn_major_tma_aligned(asf)), (bq, bsf), d)
    return d


def m_grouped_fp8_gemm_nt_contiguous(a, b, m_indices, out_dtype):
    _bf16_only("m_grouped_fp8_gemm_nt_contiguous", out_dtype)
    (aq, asf), (bq, bsf) = a, b
    d = torch.empty(aq.shape[0], bq.shape[1], dtype=torch.bfloat16, device=aq.device)
    _call("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
          (aq, to_mn_major_tma_aligned(asf)), (bq, bsf), d, m_indices)
    # DeepGEMM leaves padding rows untouched; our contract is zeros there
    return d.masked_fill_((m_indices < 0)[:, None], 0)


def m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m, out_dtype):
    _bf16_only("m_grouped_fp8_gemm_nt_masked", out_dtype)
    (aq, asf), (bq, bsf) = a, b
    d = torch.empty(aq.shape[0], aq.shape[1], bq.shape[1], dtype=torch.bfloat16, device=aq.device)
    _call("m_grouped_fp8_gemm_nt_masked", "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
          (aq, to_mn_major_tma_aligned(asf)), (bq, bsf), d, masked_m, expected_m)
    return d
