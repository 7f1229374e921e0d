"""Plain-PyTorch GEMMs: the definition of what every backend computes.

All products are ``D = A @ B.T`` (NT). The FP8 ops dequantize their ``(q, sf)`` operands to
float32 and multiply in float32, so a kernel is judged only by what it adds to the quantization
error. Inputs are assumed valid (the public functions in ``__init__`` check them).

Legend: M rows (tokens), N output features, K reduction, G groups, T rows of a K-grouped operand.
"""

from __future__ import annotations

import torch

from .._opaque import tracing
from ..fp8 import reference as fp8_ref
from . import offsets as off
from .grouped_eager import grouped_gemm_nt_offsets_eager, k_grouped_gemm_tn_eager
from .layout import BLOCK


def gemm_nt(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K], b [N, K] -> [M, N]."""
    if out_dtype == a.dtype:
        return a @ b.t()
    return (a.float() @ b.float().t()).to(out_dtype)


def _direct_grouped_mm(a: torch.Tensor) -> bool:
    """Whether the grouped GEMMs below run as plain traceable code here: on CUDA in bf16 (no host
    read, a dtype torch._grouped_mm's meta kernel takes). Elsewhere they read offsets on the host
    (CPU tensors: free) or run torch._grouped_mm on a dtype its meta kernel rejects, so they run
    inside a custom op (:mod:`._opaque_ops`) that compile and FakeTensor see as one node."""
    return a.device.type == "cuda" and (a.dtype == torch.bfloat16 or not tracing(a))


def _eager_without_grad(*tensors: torch.Tensor) -> bool:
    """Not traced and no gradient to record (inference): the custom op would run the same eager code
    under no_grad, and its first call imports torch._dynamo (~2 CPU-s per inference process)."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) and not tracing(*tensors)


def grouped_gemm_nt_offsets(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K], b [G, N, K], offsets [G] int32 (cumulative ends) -> [M, N]; rows past
    ``offsets[-1]`` are zero (and their input is never read, NaN included). Differentiable."""
    if _direct_grouped_mm(a) or _eager_without_grad(a, b, offsets):
        return grouped_gemm_nt_offsets_eager(a, b, offsets, out_dtype)
    from . import _opaque_ops

    return _opaque_ops.grouped_gemm_nt_offsets(a, b, offsets, out_dtype)


def grouped_gemm_nt_m_indices(a: torch.Tensor, b: torch.Tensor, m_indices: torch.Tensor,
                              out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K], b [G, N, K], m_indices [M] int32 (-1 = padding row, output zero) -> [M, N].

    Rows are stably sorted by group, multiplied group by group, and scattered back, so any order
    of ``m_indices`` is accepted here (the kernels need DeepGEMM's aligned contiguous layout)."""
    num_groups = b.shape[0]
    key = torch.where(m_indices < 0, num_groups, m_indices).long()
    perm = torch.argsort(key, stable=True)
    # bincount's output size depends on the data; a scatter_add into num_groups + 1 bins does not
    counts = torch.zeros(num_groups + 1, dtype=torch.long, device=key.device).scatter_add_(
        0, key, torch.ones_like(key))[:num_groups]
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    out_sorted = grouped_gemm_nt_offsets(a.index_select(0, perm), b, offsets, out_dtype)
    return out_sorted.index_select(0, torch.argsort(perm))


def grouped_gemm_nt_masked(a: torch.Tensor, b: torch.Tensor, masked_m: torch.Tensor, out_dtype: torch.dtype,
                           d: torch.Tensor | None = None) -> torch.Tensor:
    """a [G, Mmax, K], b [G, N, K], masked_m [G] -> [G, Mmax, N]; rows past masked_m are zero, or,
    when ``d`` [G, Mmax, N] (dtype out_dtype) is given, the valid rows are written into it and the
    others keep what it holds."""
    valid = (torch.arange(a.shape[1], device=a.device)[None, :] < masked_m[:, None])[..., None]
    a_in = torch.where(valid, a, torch.zeros((), dtype=a.dtype, device=a.device))
    if out_dtype != a.dtype:
        a_in, b = a_in.float(), b.float()
    out = torch.bmm(a_in, b.transpose(-2, -1))
    if d is not None:
        return torch.where(valid, out.to(out_dtype), d, out=d)
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device)).to(out_dtype)


def k_grouped_gemm_tn(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a [T, N], b [T, K], offsets [G] along T -> d [G, N, K], d[g] = a_g.T @ b_g (weight gradient
    of grouped experts: a = dY, b = X). Rows past offsets[-1] are never read. Differentiable.

    The float32 accumulation runs ``torch._grouped_mm`` on float32 operands (CPU) or a per-group
    loop over host offsets: neither traces (the meta kernel takes bf16 only), so outside CUDA eager
    it runs inside a custom op (:mod:`._opaque_ops`), the same code traced or not."""
    if a.device.type == "cuda" and not tracing(a):
        return k_grouped_gemm_tn_eager(a, b, offsets, out_dtype)
    from . import _opaque_ops

    return _opaque_ops.k_grouped_gemm_tn(a, b, offsets, out_dtype)


# ---------------------------------------------------------------- FP8 (dequantize, then fp32)


def dequant_token_group(q: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """q [..., K] * sf [..., K/128] broadcast over each 128-run (the same product as fp8.dequant,
    without materializing the expanded scales)."""
    return (q.float().unflatten(-1, (-1, BLOCK)) * sf.unsqueeze(-1)).flatten(-2)


def dequant_block(q: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    if q.shape[-2] % BLOCK:
        return fp8_ref.dequant(q, sf, (BLOCK, BLOCK), torch.float32)
    blocks = q.float().unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, BLOCK))  # [.., nb, 128, kb, 128]
    return (blocks * sf[..., :, None, :, None]).flatten(-2).flatten(-3, -2)


def dequant_b(q: torch.Tensor, sf: torch.Tensor, sb_gran: int = BLOCK) -> torch.Tensor:
    """B operand: 128x128 block scales (recipe (1, 128, 128)) or per-row 1x128 scales (1, 1, 128)."""
    return dequant_block(q, sf) if sb_gran == BLOCK else dequant_token_group(q, sf)


def fp8_gemm_nt(a, b, out_dtype, sb_gran=BLOCK, c=None):
    """(aq [M, K], asf [M, K/128]) x (bq [N, K], bsf [ceil(N/128) or N, K/128]) (+ c [M, N]
    float32) -> [M, N]."""
    out = dequant_token_group(*a) @ dequant_b(*b, sb_gran).t()
    return (out if c is None else out + c).to(out_dtype)


def m_grouped_fp8_gemm_nt_contiguous(a, b, m_indices, out_dtype, sb_gran=BLOCK):
    return grouped_gemm_nt_m_indices(dequant_token_group(*a), dequant_b(*b, sb_gran), m_indices,
                                     torch.float32).to(out_dtype)


def m_grouped_fp8_gemm_nt_offsets(a, b, offsets, out_dtype):
    return grouped_gemm_nt_offsets(dequant_token_group(*a), dequant_block(*b), offsets, torch.float32).to(out_dtype)


def m_grouped_fp8_gemm_nt_masked(a, b, masked_m, out_dtype, sb_gran=BLOCK, d=None):
    """Rows past masked_m are zero, or keep what ``d`` holds (see grouped_gemm_nt_masked)."""
    return grouped_gemm_nt_masked(dequant_token_group(*a), dequant_b(*b, sb_gran), masked_m, out_dtype, d)


def _row_blocks(offsets: torch.Tensor, num_rows: int, block: int = BLOCK) -> torch.Tensor:
    """Scale row of every row of a K-grouped operand; rows outside every group get -1."""
    group = off.offsets_to_m_indices(offsets, num_rows)
    safe = group.clamp_min(0).long()
    starts = off.offsets_to_starts(offsets)
    rows = torch.arange(num_rows, device=offsets.device, dtype=torch.int32)
    blk = off.group_block_starts(offsets, block)[safe] + (rows - starts[safe]) // block
    return torch.where(group >= 0, blk, -1)


def quant_per_group_colwise(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype, ue8m0: bool,
                            rounding: str = "reciprocal", layout: str = "rows"):
    """x [T, C] -> q [T, C] fp8 (layout "blocks": [R, C, 128], see rows_to_group_blocks),
    sf [R = max_group_blocks(T, G), C] float32.

    Column-wise scales over 128-row blocks that restart at every group's first row (a block never
    crosses a group boundary). Scale row of row r in group g: ``group_block_starts(offsets)[g] +
    (r - start_g) // 128``. Unused scale rows hold the scale of an all-zero block; rows past
    ``offsets[-1]`` are quantized to zero and never read."""
    num_rows, cols = x.shape
    nblocks = off.max_group_blocks(num_rows, offsets.numel())
    blk = _row_blocks(offsets, num_rows)
    valid = blk >= 0
    xa = torch.where(valid[:, None], x.float(), torch.zeros((), device=x.device))
    idx = torch.where(valid, blk, nblocks).long()[:, None].expand(num_rows, cols)
    amax = torch.zeros(nblocks + 1, cols, device=x.device).scatter_reduce(0, idx, xa.abs(), "amax", include_self=True)
    sf = fp8_ref.scale_from_amax(amax[:nblocks], dtype, ue8m0)
    operand = fp8_ref.cast_operand(sf, rounding)[idx[:, 0].clamp_max(nblocks - 1)]
    q = fp8_ref.cast_with(xa, operand, dtype, rounding)
    if layout == "blocks":
        q = rows_to_group_blocks(q, offsets, nblocks)
    return q, sf.contiguous()


def dequant_group_colwise(q: torch.Tensor, sf: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    blk = _row_blocks(offsets, q.shape[0])
    valid = blk >= 0
    out = q.float() * sf[blk.clamp_min(0).long()]
    return torch.where(valid[:, None], out, torch.zeros((), device=q.device))


def _block_rows(offsets: torch.Tensor, num_blocks: int, block: int = BLOCK) -> torch.Tensor:
    """[num_blocks, block] source row of each slot of the group-blocks layout (-1: padding, spare)."""
    counts = off.offsets_to_counts(offsets)
    nblocks = (counts + block - 1) // block
    starts = off.group_block_starts(offsets, block)
    blk = torch.arange(num_blocks, device=offsets.device, dtype=torch.int32)
    g = (torch.searchsorted(starts + nblocks, blk, right=True)).clamp_max(offsets.numel() - 1)
    local = (blk - starts[g])[:, None] * block + torch.arange(block, device=offsets.device, dtype=torch.int32)
    rows = off.offsets_to_starts(offsets)[g][:, None] + local
    valid = (blk < (starts + nblocks)[-1])[:, None] & (local < counts[g][:, None])
    return torch.where(valid, rows, -1)


def rows_to_group_blocks(q: torch.Tensor, offsets: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """q [T, C] (a K-grouped operand, rows grouped by offsets) -> [num_blocks, C, 128]: slot
    [r, c, i] holds row i of scale block r (see quant_per_group_colwise), zero past its group's
    end and in spare blocks."""
    src = _block_rows(offsets, num_blocks)
    taken = q.view(torch.uint8)[src.clamp_min(0).long()]  # [R, 128, C]
    taken = torch.where((src >= 0)[:, :, None], taken, torch.zeros((), dtype=torch.uint8, device=q.device))
    return taken.transpose(1, 2).contiguous().view(q.dtype)


def group_blocks_to_rows(qb: torch.Tensor, offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse of :func:`rows_to_group_blocks`: [R, C, 128] -> q [num_rows, C], rows outside every
    group zero."""
    blk = _row_blocks(offsets, num_rows)
    local = (torch.arange(num_rows, device=qb.device) - off.offsets_to_starts(offsets)[
        off.offsets_to_m_indices(offsets, num_rows).clamp_min(0).long()]) % BLOCK
    rows = qb.view(torch.uint8)[blk.clamp_min(0).long(), :, local.long()]  # [T, C]
    rows = torch.where((blk >= 0)[:, None], rows, torch.zeros((), dtype=torch.uint8, device=qb.device))
    return rows.view(qb.dtype)


def k_grouped_fp8_gemm_tn_contiguous(a, b, offsets, out_dtype, c=None):
    """(aq [T, N], asf) x (bq [T, K], bsf) with colwise group scales (+ c [G, N, K] float32) -> [G, N, K]."""
    a_hat = dequant_group_colwise(a[0], a[1], offsets)
    b_hat = dequant_group_colwise(b[0], b[1], offsets)
    out = k_grouped_gemm_tn(a_hat, b_hat, offsets, torch.float32)
    return (out if c is None else out + c).to(out_dtype)
