"""Scale-factor layouts DeepGEMM takes, in plain torch (so they run and are tested on CPU).

* K-major float32 scales ``sf[(G,) MN, SK]``: what primerl's quantizers write (``SK = K / 128``).
* MN-major TMA-aligned float32 (SM90): the same values with the MN dim contiguous and padded to a
  multiple of 16 bytes, strides ``(MN_aligned * SK, 1, MN_aligned)``; the padding is zero.
* packed UE8M0 int32 (SM100): each power-of-two scale is its 8-bit biased exponent, four K groups
  to an int32 (little-endian bytes: group ``4i + j`` is byte ``j`` of word ``i``; missing groups
  are byte 0), stored MN-major TMA-aligned: ``[(G,) MN, ceil(SK / 4)]`` int32 with strides
  ``(MN_aligned * ceil(SK / 4), 1, MN_aligned)``.

:func:`transform_sf_into_required_layout` picks among them by recipe and architecture, as
DeepGEMM's function of that name does.
"""

from __future__ import annotations

import torch

from .offsets import current_arch_major

BLOCK = 128  # the FP8 scale block: 128 K-columns per A scale, 128 x 128 per B block scale
TMA_ALIGNMENT_BYTES = 16
RECIPES = ((1, 128, 128), (1, 1, 128))


def get_tma_aligned_size(mn: int, element_size: int) -> int:
    """Round ``mn`` up so that a row of ``mn`` elements is a multiple of 16 bytes."""
    align = TMA_ALIGNMENT_BYTES // element_size
    return -(-mn // align) * align


def _mn_major_tma_aligned(values: torch.Tensor) -> torch.Tensor:
    """[(G,) MN, S] any layout -> same values, MN-major, MN padded to the TMA alignment with zeros."""
    mn, s = values.shape[-2:]
    aligned = get_tma_aligned_size(mn, values.element_size())
    buf = values.new_zeros(*values.shape[:-2], s, aligned)
    buf[..., :mn] = values.transpose(-1, -2)
    return buf.transpose(-1, -2)[..., :mn, :]


def get_mn_major_tma_aligned_tensor(sf: torch.Tensor) -> torch.Tensor:
    """float32 ``sf[(G,) MN, SK]`` -> the same values stored MN-major and TMA-aligned (SM90's A-side
    layout); strides ``(MN_aligned * SK, 1, MN_aligned)``."""
    if not isinstance(sf, torch.Tensor) or sf.dim() not in (2, 3) or sf.dtype != torch.float32:
        raise ValueError(f"get_mn_major_tma_aligned_tensor: sf must be a 2-D/3-D float32 tensor, got "
                         f"{getattr(sf, 'shape', type(sf).__name__)} {getattr(sf, 'dtype', '')}")
    return _mn_major_tma_aligned(sf)


def is_mn_major_tma_aligned(sf: torch.Tensor) -> bool:
    mn = sf.shape[-2]
    aligned = get_tma_aligned_size(mn, sf.element_size())
    ok = sf.stride(-2) == 1 and (sf.shape[-1] == 1 or sf.stride(-1) == aligned)
    if sf.dim() == 3:
        ok = ok and sf.stride(0) == aligned * sf.shape[-1]
    return ok


def _check_power_of_two(op: str, sf: torch.Tensor) -> None:
    bits = sf.view(torch.int32)
    bad = ((bits & 0x7FFFFF) != 0) | (bits < 0) | (((bits >> 23) & 0xFF) == 0)
    if bool(bad.any()):  # one host sync
        raise ValueError(f"{op}: sf holds {int(bad.sum())} values that are not positive powers of two (UE8M0 "
                         f"stores only the exponent); quantize with ue8m0=True")


def pack_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 ``sf[..., SK]`` -> int32 ``[..., ceil(SK / 4)]`` (K-major), four biased
    exponents per word, little-endian, zero bytes for the missing groups."""
    op = "pack_ue8m0"
    if not isinstance(sf, torch.Tensor) or sf.dtype != torch.float32 or sf.dim() < 1:
        raise ValueError(f"{op}: sf must be a float32 tensor with a K dim, got "
                         f"{getattr(sf, 'dtype', type(sf).__name__)}")
    _check_power_of_two(op, sf)
    sk = sf.shape[-1]
    exps = (sf.contiguous().view(torch.int32) >> 23).to(torch.uint8)
    padded = exps.new_zeros(*sf.shape[:-1], -(-sk // 4) * 4)
    padded[..., :sk] = exps
    return padded.view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, num_groups_k: int) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0` (any strides): int32 ``[..., ceil(SK / 4)]`` -> float32
    ``[..., SK]`` with ``SK = num_groups_k``, contiguous."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32:
        raise ValueError(f"unpack_ue8m0: packed scales must be int32, got "
                         f"{getattr(packed, 'dtype', type(packed).__name__)}")
    if packed.shape[-1] != -(-num_groups_k // 4):
        raise ValueError(f"unpack_ue8m0: {num_groups_k} K groups pack into {-(-num_groups_k // 4)} int32 words, "
                         f"got {packed.shape[-1]}")
    dense = packed.new_empty(packed.shape).copy_(packed)  # standard strides (a size-1 K dim may have any)
    exps = dense.view(torch.uint8)[..., :num_groups_k]
    return (exps.to(torch.int32) << 23).view(torch.float32)


def get_mn_major_tma_aligned_packed_ue8m0_tensor(sf: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 ``sf[(G,) MN, SK]`` -> packed UE8M0 int32 ``[(G,) MN, ceil(SK / 4)]``,
    MN-major and TMA-aligned (SM100's layout). Raises on a scale that is not a power of two."""
    if not isinstance(sf, torch.Tensor) or sf.dim() not in (2, 3) or sf.dtype != torch.float32:
        raise ValueError(f"get_mn_major_tma_aligned_packed_ue8m0_tensor: sf must be a 2-D/3-D float32 tensor, "
                         f"got {getattr(sf, 'shape', type(sf).__name__)} {getattr(sf, 'dtype', '')}")
    return _mn_major_tma_aligned(pack_ue8m0(sf))


def transform_sf_into_required_layout(sf: torch.Tensor, mn: int, k: int, recipe: tuple[int, int, int],
                                      num_groups: int | None = None, is_sfa: bool = False,
                                      disable_ue8m0_cast: bool = False, *,
                                      arch_major: int | None = None) -> torch.Tensor:
    """DeepGEMM's scale layout for an operand of ``mn`` rows and ``k`` columns.

    ``recipe`` = (A rows, B rows, K) per scale; the operand's row granularity is ``recipe[0]`` for
    A (``is_sfa``) else ``recipe[1]``. ``sf`` is float32 ``[(G,) ceil(mn / gran), ceil(k / 128)]``
    or, on SM100, already packed int32 (returned MN-major TMA-aligned). SM90 (or
    ``disable_ue8m0_cast``): per-row float32 scales go MN-major TMA-aligned, 128-row block scales
    stay as they are. SM100: float32 scales are broadcast to rows and packed to UE8M0 (they must be
    powers of two). ``arch_major`` defaults to the current CUDA device's.
    """
    op = "transform_sf_into_required_layout"
    if tuple(recipe) not in RECIPES:
        raise ValueError(f"{op}: recipe must be one of {RECIPES}, got {recipe!r}")
    gran_mn, gran_k = (recipe[0] if is_sfa else recipe[1]), recipe[2]
    if arch_major is None:
        arch_major = current_arch_major()
    if arch_major not in (9, 10):
        raise ValueError(f"{op}: DeepGEMM layouts exist for SM90 and SM100, got arch_major={arch_major}")
    want = (*((num_groups,) if num_groups is not None else ()), -(-mn // gran_mn), -(-k // gran_k))
    if sf.dtype == torch.int32:
        want = (*want[:-1], -(-want[-1] // 4))
        if arch_major != 10 or gran_mn != 1:
            raise ValueError(f"{op}: packed int32 UE8M0 scales are SM100's per-row layout (gran 1), "
                             f"got arch_major={arch_major}, granularity {gran_mn}")
    elif sf.dtype != torch.float32:
        raise ValueError(f"{op}: sf must be float32 or packed int32, got {sf.dtype}")
    if tuple(sf.shape) != want:
        raise ValueError(f"{op}: sf must have shape {want} for mn={mn}, k={k}, recipe={tuple(recipe)}, "
                         f"got {tuple(sf.shape)}")
    if sf.dtype == torch.int32:
        return sf if is_mn_major_tma_aligned(sf) else _mn_major_tma_aligned(sf)
    if arch_major == 9 or disable_ue8m0_cast:
        return get_mn_major_tma_aligned_tensor(sf) if gran_mn == 1 else sf.contiguous()
    if gran_mn != 1:
        rows = torch.arange(mn, device=sf.device) // gran_mn
        sf = sf.index_select(-2, rows)
    return get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)
