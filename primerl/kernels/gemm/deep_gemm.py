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

The K-grouped GEMM (``k_grouped_fp8_gemm_tn_contiguous``, v2 only) is narrower: SM100 only (on SM90
DeepGEMM's K-grouped FP8 GEMM is the K-major ``k_grouped_fp8_gemm_nt_contiguous`` of recent versions,
which primerl does not route to), recipe (1, 1, 128), e4m3 operands, per-group sizes ``ks`` that are
multiples of 128 and of the contiguous-layout alignment, at most 128 groups, float32 output, and
float32 scales with one compact row per 128-row block (``sum(ks) / 128`` rows, which DeepGEMM packs
to UE8M0 itself). All of it is checked here before DeepGEMM is called.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from .layout import (
    BLOCK,
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


def _arch_names(archs) -> str:
    names = {9: "SM90 (Hopper)", 10: "SM100 (Blackwell)"}
    return " and ".join(names.get(a, f"SM{a}0") for a in archs)


def _check_device_arch(op: str, device: torch.device, archs=SUPPORTED_ARCHS) -> tuple[int, int]:
    major, minor = device_capability(device)
    if major not in archs:
        where = f"the deep_gemm backend runs on {_arch_names(archs)}" if tuple(archs) == SUPPORTED_ARCHS else \
            f"DeepGEMM has this op on {_arch_names(archs)} only"
        raise ValueError(f"{op}: {where}; {device} is SM{major}{minor}. Use backend='triton'")
    return major, minor


def _check_ue8m0(op: str, device: torch.device, scales: dict[str, torch.Tensor]) -> None:
    for name, sf in scales.items():
        bad = _not_power_of_two(sf)
        if bad:
            raise ValueError(
                f"{op}: DeepGEMM on SM100 ({device}) reads UE8M0 scales (powers of two) only, but {name} holds "
                f"{bad} float32 scales that are not powers of two; they would be truncated to their exponent "
                f"(wrong results) or trap. Quantize with ue8m0=True (or pass packed int32 UE8M0 scales), "
                f"or use backend='triton'")


def _check_arch_recipe(op: str, device: torch.device, recipe, archs=SUPPORTED_ARCHS) -> int:
    major, _ = _check_device_arch(op, device, archs)
    if major == 9 and tuple(recipe) != (1, 128, 128):
        raise ValueError(f"{op}: recipe {tuple(recipe)} (per-row B scales) needs SM100; DeepGEMM on SM90 "
                         f"takes (1, 128, 128)")
    return major


def check_arch(op: str, device: torch.device, scales: dict[str, torch.Tensor], recipe=(1, 128, 128),
               archs=SUPPORTED_ARCHS) -> int:
    """The CUDA architecture major of ``device`` if DeepGEMM can take these scales there, else a
    ValueError naming the problem. ``scales``: name -> float32 K-major scales of each operand;
    ``archs``: the majors the op exists on (SM90 and SM100 unless an op is narrower). On SM100 the
    scales' values are read (one host read): the ops below check them inside their custom op."""
    major = _check_arch_recipe(op, device, recipe, archs)
    if major == 10:
        _check_ue8m0(op, device, scales)
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
        has = f"neither {new_name} nor {old_name}" if old_name else f"no {new_name} (added in DeepGEMM v2)"
        raise RuntimeError(f"deep_gemm has {has}; unsupported DeepGEMM version")
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


# ------------------------------------------------------------------------------ one custom op per call
# Each DeepGEMM call is a torch.library custom op that writes the caller's d in place (DeepGEMM's
# convention; its fake kernel has nothing to allocate), so torch.compile and FakeTensorMode see one
# opaque node per call and never import deep_gemm. Shape and architecture checks run before it (at
# trace time too); its body holds what needs the real device: the scale-layout transform and, on
# SM100, the check that float32 scales are powers of two (a host read). ``c`` may be d itself
# (accumulate in place): an op may not take its mutated tensor twice, so that case is ``c_is_d``.


def _c_args(c, d):
    return (None, True) if c is d else (c, False)


def _scales_for(op: str, arch: int, device, a, b, recipe, num_groups_b, num_groups_a=None):
    if arch == 10:
        _check_ue8m0(op, device, {"a scales": a[1], "b scales": b[1]})
    return _operands(a, b, arch, tuple(recipe), num_groups_b, num_groups_a)


@torch.library.custom_op("primerl::deep_gemm_fp8_gemm_nt", mutates_args=("d",))
def _fp8_gemm_nt_op(aq: torch.Tensor, asf: torch.Tensor, bq: torch.Tensor, bsf: torch.Tensor, d: torch.Tensor,
                    c: Optional[torch.Tensor], c_is_d: bool, recipe: list[int], arch: int) -> None:
    op = "fp8_gemm_nt"
    a, b = _scales_for(op, arch, d.device, (aq, asf), (bq, bsf), recipe, None)
    _call(op, "fp8_gemm_nt", "gemm_fp8_fp8_bf16_nt", (a, b, d), {"c": d if c_is_d else c, "recipe": tuple(recipe)})


@_fp8_gemm_nt_op.register_fake
def _(aq, asf, bq, bsf, d, c, c_is_d, recipe, arch):
    return None


@torch.library.custom_op("primerl::deep_gemm_m_grouped_fp8_gemm_nt_contiguous", mutates_args=("d",))
def _m_grouped_contiguous_op(aq: torch.Tensor, asf: torch.Tensor, bq: torch.Tensor, bsf: torch.Tensor,
                             grouped_layout: torch.Tensor, m_indices: torch.Tensor, d: torch.Tensor,
                             use_psum_layout: bool, recipe: list[int], arch: int) -> None:
    op = "m_grouped_fp8_gemm_nt_contiguous"
    a, b = _scales_for(op, arch, d.device, (aq, asf), (bq, bsf), recipe, bq.shape[0])
    kwargs = {"recipe": tuple(recipe)}
    if use_psum_layout:
        kwargs["use_psum_layout"] = True
    _call(op, "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
          (a, b, d, grouped_layout), kwargs)
    d.masked_fill_((m_indices < 0)[:, None], 0)  # DeepGEMM leaves padding rows untouched


@_m_grouped_contiguous_op.register_fake
def _(aq, asf, bq, bsf, grouped_layout, m_indices, d, use_psum_layout, recipe, arch):
    return None


@torch.library.custom_op("primerl::deep_gemm_m_grouped_fp8_gemm_nt_masked", mutates_args=("d",))
def _m_grouped_masked_op(aq: torch.Tensor, asf: torch.Tensor, bq: torch.Tensor, bsf: torch.Tensor,
                         masked_m: torch.Tensor, expected_m: int, d: torch.Tensor, recipe: list[int],
                         arch: int) -> None:
    op = "m_grouped_fp8_gemm_nt_masked"
    a, b = _scales_for(op, arch, d.device, (aq, asf), (bq, bsf), recipe, bq.shape[0], num_groups_a=aq.shape[0])
    _call(op, "m_grouped_fp8_gemm_nt_masked", "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
          (a, b, d, masked_m, expected_m), {"recipe": tuple(recipe)})


@_m_grouped_masked_op.register_fake
def _(aq, asf, bq, bsf, masked_m, expected_m, d, recipe, arch):
    return None


def fp8_gemm_nt(a, b, d, c, recipe):
    """d [M, N] (bf16 / float32) = a @ b.T (+ c) through DeepGEMM; a = (q [M, K], sf), b = (q [N, K], sf)."""
    arch = _check_arch_recipe("fp8_gemm_nt", d.device, recipe)
    _fp8_gemm_nt_op(a[0], a[1], b[0], b[1], d, *_c_args(c, d), list(recipe), arch)
    return d


def m_grouped_fp8_gemm_nt_contiguous(a, b, grouped_layout, d, use_psum_layout, recipe, m_indices=None):
    """d [M, N]: row i uses b[group of row i] (``grouped_layout``: m_indices [M] or, with
    use_psum_layout, psum [G]); rows where ``m_indices`` [M] (default: grouped_layout) is -1 are
    zeroed after the call (DeepGEMM leaves them untouched)."""
    op = "m_grouped_fp8_gemm_nt_contiguous"
    arch = _check_arch_recipe(op, d.device, recipe)
    alignment = get_mk_alignment_for_contiguous_layout()
    if a[0].shape[0] % alignment:
        raise ValueError(f"{op}: the deep_gemm backend needs M={a[0].shape[0]} to be a multiple of "
                         f"get_mk_alignment_for_contiguous_layout()={alignment} (set it to DeepGEMM's value)")
    if m_indices is None:
        if use_psum_layout:
            raise ValueError(f"{op}: with use_psum_layout the padding rows to zero need m_indices")
        m_indices = grouped_layout
    _m_grouped_contiguous_op(a[0], a[1], b[0], b[1], grouped_layout, m_indices, d, bool(use_psum_layout),
                             list(recipe), arch)
    return d


def m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m, d, recipe):
    """d [G, max_m, N]: the first masked_m[g] rows of group g (a = (q [G, max_m, K], sf))."""
    arch = _check_arch_recipe("m_grouped_fp8_gemm_nt_masked", d.device, recipe)
    _m_grouped_masked_op(a[0], a[1], b[0], b[1], masked_m, int(expected_m), d, list(recipe), arch)
    return d


K_GROUPED_ARCHS = (10,)
K_GROUPED_MAX_GROUPS = 128  # DeepGEMM's UE8M0 packing kernel for K-grouped scales asserts this
K_GROUPED_RECIPE = (1, 1, 128)


def _check_k_grouped_shapes(op: str, aq, bq, num_groups: int, d: torch.Tensor) -> None:
    """What DeepGEMM's K-grouped kernel would assert that shapes and types tell (checked before the op)."""
    for name, q in (("a", aq), ("b", bq)):
        if q.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{op}: the deep_gemm backend takes float8_e4m3fn operands, {name}[0] is {q.dtype}")
    if d.dtype != torch.float32 or not d.is_contiguous():
        raise ValueError(f"{op}: the deep_gemm backend writes a contiguous float32 d (the output type every DeepGEMM "
                         f"version's K-grouped kernel takes), got {d.dtype} with strides {d.stride()}")
    if num_groups > K_GROUPED_MAX_GROUPS:
        raise ValueError(f"{op}: DeepGEMM's K-grouped GEMM takes at most {K_GROUPED_MAX_GROUPS} groups, "
                         f"got {num_groups}")
    for name, q in (("a", aq), ("b", bq)):
        if q.shape[1] % 16:
            raise ValueError(f"{op}: {name}[0] has {q.shape[1]} columns; DeepGEMM's TMA loads need 16-byte rows "
                             f"(a multiple of 16 fp8 columns)")


def _check_k_grouped_sizes(op: str, asf, bsf, ks: list[int]) -> int:
    """What DeepGEMM's K-grouped kernel would assert (or silently get wrong) about the group sizes (host
    values, inside the op) -> the number of compact scale rows, ``sum(ks) / 128``."""
    alignment = get_mk_alignment_for_contiguous_layout()
    bad = [k for k in ks if k % BLOCK or k % alignment]
    if bad:
        raise ValueError(f"{op}: the deep_gemm backend needs every group size in ks to be a multiple of {BLOCK} and of "
                         f"get_mk_alignment_for_contiguous_layout()={alignment} (DeepGEMM's K alignment), got ks={ks}; "
                         f"pad each group to it, or use backend='triton' (any group sizes)")
    rows = sum(ks) // BLOCK
    for name, sf in (("a", asf), ("b", bsf)):
        if sf.shape[0] < rows:
            raise ValueError(f"{op}: {name} scales have {sf.shape[0]} rows, ks={ks} need {rows} "
                             f"(one per 128-row block)")
    return rows


@torch.library.custom_op("primerl::deep_gemm_k_grouped_fp8_gemm_tn_contiguous", mutates_args=("d",))
def _k_grouped_op(aq: torch.Tensor, asf: torch.Tensor, bq: torch.Tensor, bsf: torch.Tensor, ks: torch.Tensor,
                  d: torch.Tensor, c: Optional[torch.Tensor], c_is_d: bool) -> None:
    op = "k_grouped_fp8_gemm_tn_contiguous"
    ks_list = [int(k) for k in ks.tolist()]  # DeepGEMM takes the sizes as a host list: one read when on the GPU
    rows = _check_k_grouped_sizes(op, asf, bsf, ks_list)
    total = sum(ks_list)
    sfa, sfb = asf[:rows].contiguous(), bsf[:rows].contiguous()
    _check_ue8m0(op, d.device, {"a scales": sfa, "b scales": sfb})
    fn, _ = _fn(op, None)
    accumulate = c_is_d or c is not None
    if c is not None:
        d.copy_(c)
    ks_tensor = ks.to(device=d.device, dtype=torch.int32)
    fn((aq[:total], sfa), (bq[:total], sfb), d, ks_list, ks_tensor,
       c=d if accumulate else None, recipe=K_GROUPED_RECIPE)
    empty = [g for g, k in enumerate(ks_list) if k == 0]
    if not accumulate and empty:
        d.index_fill_(0, torch.tensor(empty, device=d.device), 0.0)


@_k_grouped_op.register_fake
def _(aq, asf, bq, bsf, ks, d, c, c_is_d):
    return None


def k_grouped_fp8_gemm_tn_contiguous(a, b, ks, d: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    """``d[g] = A_g.T @ B_g (+ c[g])`` through DeepGEMM's ``k_grouped_fp8_gemm_tn_contiguous``.

    a = (q [T, M] e4m3, sf [R, M] float32), b = (q [T, N], sf [R, N]) from
    ``quant_per_group_colwise`` (static or compact scale rows); ``ks[G]`` the rows of each group, from
    row 0 on: a host list or an int tensor (read on the host inside the op: DeepGEMM takes a list);
    d float32 [G, M, N] contiguous; c None or float32 [G, M, N] (may be d). M and N are DeepGEMM's
    names; the front-end calls them N and K.

    DeepGEMM gets ``(a, b, d, ks, ks_tensor, c=..., recipe=(1, 1, 128))``: the first ``sum(ks)``
    rows of each q, the first ``sum(ks) / 128`` scale rows (its compact per-group layout, float32
    contiguous; it packs them to UE8M0 itself), ``ks_tensor`` = ks as int32 on d's device, and
    ``c=d`` after c is copied into d (older DeepGEMM versions assert that c is d). Without c, groups
    with ``ks[g] == 0`` are zeroed afterwards (DeepGEMM may skip them). One custom op
    (``primerl::deep_gemm_k_grouped_fp8_gemm_tn_contiguous``) does the value checks, the copy and
    the call; d is untouched when a check refuses."""
    op = "k_grouped_fp8_gemm_tn_contiguous"
    _check_device_arch(op, d.device, K_GROUPED_ARCHS)
    (aq, asf), (bq, bsf) = a, b
    if not isinstance(ks, torch.Tensor):
        ks = torch.tensor(list(ks), dtype=torch.int32)
    _check_k_grouped_shapes(op, aq, bq, ks.numel(), d)
    _k_grouped_op(aq, asf, bq, bsf, ks, d, *_c_args(c, d))
    return d
