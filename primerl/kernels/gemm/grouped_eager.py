"""The eager grouped GEMMs: the bodies of :mod:`.reference`'s grouped ops, run directly (CUDA) or
inside the ``primerl::`` custom ops of :mod:`._opaque_ops` (CPU, or traced), and the CPU float32
per-group path with its explicit backward. Inputs are assumed valid (the public functions check
them).

Legend: M rows (tokens), N output features, K reduction, G groups, T rows of a K-grouped operand.
"""

from __future__ import annotations

import torch


def _grouped_mm_supported(x: torch.Tensor) -> bool:
    if x.device.type == "cpu":
        return x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    return x.dtype == torch.bfloat16


def _row_mask(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return mask.view(-1, *([1] * (x.dim() - 1)))


def _grouped_loop(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-group slices (one host sync): any dtype, any device, differentiable."""
    ends = offsets.tolist()
    parts, start = [], 0
    for g, end in enumerate(ends):
        parts.append(a[start:end] @ b[g].t())
        start = end
    parts.append(a.new_zeros(a.shape[0] - start, b.shape[1]))
    return torch.cat(parts)


def per_group_forward(a: torch.Tensor, b: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """CPU float32/float64: one ``torch.mm`` per group written into a preallocated output, rows
    past the last end never read (zero output). Bitwise what ``torch._grouped_mm`` computes on CPU
    (the same per-group GEMMs), without the row masking around it. (A zero-padded ``torch.bmm``
    over ``[G, max_rows, K]`` was tried: not bitwise, and slower in the MoE block on 2 cores.)"""
    out = a.new_empty(a.shape[0], b.shape[1])
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            torch.mm(a[start:end], b[g].t(), out=out[start:end])
        start = end
    out[start:].zero_()
    return out


def per_group_backward(dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ends: list[int], need_a: bool,
                       need_b: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward of :func:`per_group_forward`: bitwise ``torch._grouped_mm``'s autograd on CPU,
    without the per-group slice gradients of ``b`` (a full-size zero tensor each) that autograd
    through a Python loop would build; rows past the last end get a zero gradient."""
    da = a.new_empty(a.shape) if need_a else None
    db = b.new_empty(b.shape) if need_b else None
    start = 0
    for g, end in enumerate(ends):
        if da is not None and end > start:
            torch.mm(dout[start:end], b[g], out=da[start:end])
        if db is not None:
            if end > start:
                torch.mm(dout[start:end].t(), a[start:end], out=db[g])
            else:
                db[g].zero_()
        start = end
    if da is not None:
        da[start:].zero_()
    return da, db


class _GroupedMMPerGroup(torch.autograd.Function):
    """:func:`per_group_forward` / :func:`per_group_backward` as an autograd Function (``ends`` a
    host list)."""

    @staticmethod
    def forward(ctx, a, b, ends: list[int]):
        ctx.save_for_backward(a, b)
        ctx.ends = ends
        return per_group_forward(a, b, ends)

    @staticmethod
    def backward(ctx, dout):
        a, b = ctx.saved_tensors
        da, db = per_group_backward(dout.contiguous(), a, b, ctx.ends, ctx.needs_input_grad[0],
                                    ctx.needs_input_grad[1])
        return da, db, None


def grouped_gemm_nt_offsets_eager(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                                  out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`.reference.grouped_gemm_nt_offsets` as eager code (the body of its custom op)."""
    if out_dtype != a.dtype:
        a, b = a.float(), b.float()
    if a.device.type == "cpu" and a.dtype in (torch.float32, torch.float64):
        return _GroupedMMPerGroup.apply(a, b, offsets.tolist()).to(out_dtype)  # host sync: free on CPU
    if a.device.type == "cpu" and int(offsets[-1]) == a.shape[0] and _grouped_mm_supported(a):
        # every row is valid: the masking below is the identity (bf16/fp16 keep torch._grouped_mm,
        # whose rounding differs from torch.mm's in these dtypes)
        aligned = (a.shape[1] * a.element_size()) % 16 == 0 and (b.shape[1] * b.element_size()) % 16 == 0
        out = torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets) if aligned else _grouped_loop(a, b, offsets)
        return out.to(out_dtype)
    valid = torch.arange(a.shape[0], device=a.device) < offsets[-1]
    a_in = torch.where(_row_mask(valid, a), a, torch.zeros((), dtype=a.dtype, device=a.device))
    aligned = (a.shape[1] * a.element_size()) % 16 == 0 and (b.shape[1] * b.element_size()) % 16 == 0
    if _grouped_mm_supported(a_in) and aligned:  # its forward and backward need 16-byte strides
        # torch._grouped_mm leaves rows past offsets[-1] (and their gradient) uninitialised
        out = torch._grouped_mm(a_in, b.transpose(-2, -1), offs=offsets)
    else:
        out = _grouped_loop(a_in, b, offsets)
    out = torch.where(_row_mask(valid, out), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.to(out_dtype)


def k_grouped_gemm_tn_eager(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`.reference.k_grouped_gemm_tn` as eager code (the body of its custom op)."""
    num_rows = a.shape[0]
    valid = torch.arange(num_rows, device=a.device) < offsets[-1]
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    a = torch.where(_row_mask(valid, a), a, zero).to(acc)
    b = torch.where(_row_mask(valid, b), b, zero.to(b.dtype)).to(acc)
    if acc == torch.float32 and a.device.type == "cpu" and a.shape[1] % 4 == 0 and b.shape[1] % 4 == 0:
        out = torch._grouped_mm(a.t(), b, offs=offsets)
    else:
        ends, start, parts = offsets.tolist(), 0, []
        for end in ends:
            parts.append(a[start:end].t() @ b[start:end])
            start = end
        out = torch.stack(parts)
    return out.to(out_dtype)
