"""Adapter to DeepGEMM (Hopper / Blackwell; built from source by the user, the PyPI ``deep-gemm``
is a placeholder).

Operands arrive as primerl's K-major float32 scales; the adapter converts them to the layout the
device's DeepGEMM kernels read (:func:`.layout.transform_sf_into_required_layout`): on SM90 the A
side MN-major TMA-aligned float32, on SM100 packed UE8M0 int32. Before any call it checks the
architecture (:func:`check_arch`): DeepGEMM runs on SM90 and SM100 only, and on SM100 its kernels
take UE8M0 scales (powers of two) only, so float32 scales that are not powers of two - primerl's
default ``ue8m0=False`` quantization - are rejected with a clear error instead of being truncated
to their exponent (wrong results) or tripping DeepGEMM's device-side checks. Packed int32 UE8M0
scales are SM100's format; SM90 rejects them. Both DeepGEMM API generations are handled:
``fp8_gemm_nt`` & co (v2) and ``gemm_fp8_fp8_bf16_nt`` & co (v1, bf16 output, SM90 only).
"""

from __future__ import annotations

import importlib

import torch

from .layout import (
    TMA_ALIGNMENT_BYTES,  # noqa: F401  (re-exported for callers of the earlier module)
    get_mn_major_tma_aligned_tensor,
    get_tma_aligned_size,
    is_mn_major_tma_aligned,  # noqa: F401
    transform_sf_into_required_layout,
)
from .offsets import device_capability, get_mk_alignment_for_contiguous_layout

# earlier names of the layout helpers
tma_aligned_size = get_tma_aligned_size
to_mn_major_tma_aligned = get_mn_major_tma_aligned_tensor

SUPPORTED_ARCHS = (9, 10)


def _not_power_of_two(sf: torch.Tensor) -> int:
    bits = sf.view(torch.int32)
    return int((((bits & 0x7FFFFF) != 0) | (bits <= 0)).sum())  # one host sync


def check_arch(op: str, device: torch.device, scales: dict[str, torch.Tensor], recipe=(1, 128, 128)) -> int:
    """The CUDA architecture major of ``device`` if DeepGEMM can take these scales there, else a
    ValueError naming the problem. ``scales``: name -> float32 K-major scales of each operand."""
    major, minor = device_capability(device)
    if major not in SUPPORTED_ARCHS:
        raise ValueError(f"{op}: the deep_gemm backend runs on SM90 (Hopper) and SM100 (Blackwell); "
                         f"{device} is SM{major}{minor}. Use backend='triton'")
    if major == 9 and tuple(recipe) != (1, 128, 128):
        raise ValueError(f"{op}: recipe {tuple(recipe)} (per-row B scales) needs SM100; DeepGEMM on SM90 "
                         f"takes (1, 128, 128)")
    if major == 10:
        for name, sf in scales.items():
            bad = _not_power_of_two(sf)
            if bad:
                raise ValueError(
                    f"{op}: DeepGEMM on SM100 ({device}) reads UE8M0 scales (powers of two) only, but {name} holds "
                    f"{bad} float32 scales that are not powers of two; they would be truncated to their exponent "
                    f"(wrong results) or trap. Quantize with ue8m0=True (or pass packed int32 UE8M0 scales), "
                    f"or use backend='triton'")
    return major


def _module():
    return importlib.import_module("deep_gemm")


def _fn(new_name: str, old_name: str | None):
    dg = _module()
    fn = getattr(dg, new_name, None)
    if fn is not None:
        return fn, True
    fn = getattr(dg, old_name, None) if old_name else None
    if fn is None:
        raise RuntimeError(f"deep_gemm has neither {new_name} nor {old_name}; unsupported DeepGEMM version")
    return fn, False


def _operands(a, b, arch: int, recipe, num_groups_b: int | None, num_groups_a: int | None = None):
    (aq, asf), (bq, bsf) = a, b
    sfa = transform_sf_into_required_layout(asf, aq.shape[-2], aq.shape[-1], recipe, num_groups_a, True,
                                            arch_major=arch)
    sfb = transform_sf_into_required_layout(bsf, bq.shape[-2], bq.shape[-1], recipe, num_groups_b, False,
                                            arch_major=arch)
    return (aq, sfa), (bq, sfb)


def _call(op: str, new_name: str, old_name: str | None, args, kwargs: dict):
    fn, v2 = _fn(new_name, old_name)
    if v2:
        return fn(*args, **kwargs)
    if any(v is not None and v is not False for k, v in kwargs.items() if k != "recipe") or \
            tuple(kwargs.get("recipe") or (1, 128, 128)) != (1, 128, 128):
        raise ValueError(f"{op}: this DeepGEMM (v1 API) takes none of {sorted(kwargs)}; update DeepGEMM")
    return fn(*args)


def fp8_gemm_nt(a, b, d, c, recipe):
    op = "fp8_gemm_nt"
    arch = check_arch(op, d.device, {"a scales": a[1], "b scales": b[1]}, recipe)
    a, b = _operands(a, b, arch, recipe, None)
    _call(op, "fp8_gemm_nt", "gemm_fp8_fp8_bf16_nt", (a, b, d), {"c": c, "recipe": recipe})
    return d


def m_grouped_fp8_gemm_nt_contiguous(a, b, grouped_layout, d, use_psum_layout, recipe):
    op = "m_grouped_fp8_gemm_nt_contiguous"
    arch = check_arch(op, d.device, {"a scales": a[1], "b scales": b[1]}, recipe)
    alignment = get_mk_alignment_for_contiguous_layout()
    if a[0].shape[0] % alignment:
        raise ValueError(f"{op}: the deep_gemm backend needs M={a[0].shape[0]} to be a multiple of "
                         f"get_mk_alignment_for_contiguous_layout()={alignment} (set it to DeepGEMM's value)")
    a, b = _operands(a, b, arch, recipe, b[0].shape[0])
    kwargs = {"recipe": recipe}
    if use_psum_layout:
        kwargs["use_psum_layout"] = True
    _call(op, "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
          (a, b, d, grouped_layout), kwargs)
    return d


def m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m, d, recipe):
    op = "m_grouped_fp8_gemm_nt_masked"
    arch = check_arch(op, d.device, {"a scales": a[1], "b scales": b[1]}, recipe)
    a, b = _operands(a, b, arch, recipe, b[0].shape[0], num_groups_a=a[0].shape[0])
    _call(op, "m_grouped_fp8_gemm_nt_masked", "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
          (a, b, d, masked_m, expected_m), {"recipe": recipe})
    return d
