"""Rowwise FP8 training: the ``"rowwise"`` recipe of :mod:`.fp8_training` (dense linears and grouped
experts), the scheme of torchao's float8 rowwise recipe and torchtitan's FP8 MoE.

Every GEMM quantizes both operands to e4m3 with one float32 scale per row *along its contraction
dim* (``amax / 448``, :func:`primerl.kernels.fp8.quant_rowwise`):

* forward ``y = x @ w.T``: x per token (over K), w per output row (over K);
* dgrad ``dx = dy @ w``: dy per token (over N), w per input column (over N: ``w.T`` rowwise);
* wgrad ``dw = dy.T @ x``: dy and x per feature over the tokens (``dy.T`` / ``x.T`` rowwise). For
  grouped experts one scale per feature serves every group (the scale is constant along each
  group's contraction, so the per-group product stays exact up to quantization).

CUDA runs ``torch._scaled_mm`` (dense) and ``torch._scaled_grouped_mm`` (experts: 2D x 3D for
forward / dgrad, 2D x 2D with offsets for wgrad); both write bf16. Their alignment rules: N and K
multiples of 16 (checked by the callers) and, for the 2D x 2D wgrad, every group's token count a
multiple of 16 (16-byte rows of the transposed FP8 operand; an unaligned group trips a device-side
assert). The wgrad therefore scatters the tokens into 16-aligned groups first (:func:`pad_groups`:
a static ``M + 15 G`` rows, zeros between groups, no host sync); the dense wgrad pads the tokens to
a multiple of 16. CPU has no ``_scaled_grouped_mm`` kernel: there the same quantized operands are
dequantized and multiplied in float32 (``torch._grouped_mm`` / ``mm``), rounded to bf16 like the
GPU's output: that emulation is the test oracle.

Legend: M tokens (rows), K input features, N output features, G groups (experts).
"""

from __future__ import annotations

import contextlib

import torch

from ._opaque import tracing
from .fp8 import quant_rowwise

ALIGN = 16  # FP8 operands: 16-byte rows, so dims and wgrad token groups are multiples of 16


_EMULATE = [False]


@contextlib.contextmanager
def emulated():
    """Within this block the rowwise GEMMs run the dequantizing emulation on every device (the
    oracle the GPU kernels are tested against)."""
    _EMULATE.append(True)
    try:
        yield
    finally:
        _EMULATE.pop()


def _kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and not _EMULATE[-1]


def _q(x: torch.Tensor):
    """x [..., C] -> (q e4m3 [..., C], scale float32 [..., 1]) over the last dim."""
    return quant_rowwise(x.contiguous())


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The emulation's float32 ``torch._grouped_mm``, traceable (its meta kernel takes bf16 only)."""
    from .gemm._opaque_ops import grouped_mm

    return grouped_mm(a, b, offsets)


def scaled_mm(aq, sa, bq, sb) -> torch.Tensor:
    """aq [M, C], sa [M, 1], bq [N, C], sb [N, 1] -> bf16 [M, N] = (aq*sa) @ (bq*sb).T."""
    if _kernels(aq):
        return torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)
    return ((aq.float() * sa) @ (bq.float() * sb).t()).to(torch.bfloat16)


def scaled_grouped_mm(aq, sa, bq, sb, offsets) -> torch.Tensor:
    """m-grouped: aq [M, C], sa [M], bq [G, N, C], sb [G, N] -> bf16 [M, N]; rows
    ``offsets[g-1]:offsets[g]`` use ``b[g]``; rows past ``offsets[-1]`` are zero."""
    if _kernels(aq):
        out = torch._scaled_grouped_mm(aq, bq.transpose(-2, -1), sa, sb, offs=offsets, out_dtype=torch.bfloat16)
    else:
        a = aq.float() * sa[:, None]
        b = bq.float() * sb[..., None]
        out = _grouped_mm(a, b.transpose(-2, -1), offsets).to(torch.bfloat16)
    tail = torch.arange(out.shape[0], device=out.device) >= offsets[-1]
    return out.masked_fill_(tail[:, None], 0)


def scaled_k_grouped_mm(atq, sat, btq, sbt, offsets) -> torch.Tensor:
    """k-grouped: atq [N, Mp], sat [G*N], btq [K, Mp], sbt [G*K] (group g's scales at
    ``g*N .. g*N+N-1``) -> bf16 [G, N, K], ``out[g] = a[:, group g] @ b[:, group g].T``; offsets
    (cumulative ends along Mp) multiples of 16 on CUDA."""
    groups = offsets.numel()
    if _kernels(atq):
        return torch._scaled_grouped_mm(atq, btq.t(), sat, sbt, offs=offsets, out_dtype=torch.bfloat16)
    cols = torch.arange(atq.shape[1], device=atq.device)
    grp = torch.searchsorted(offsets, cols, right=True).clamp_max(groups - 1)
    a = atq.float() * sat.view(groups, -1)[grp].t()
    b = btq.float() * sbt.view(groups, -1)[grp].t()
    return _grouped_mm(a, b.t(), offsets).to(torch.bfloat16)


def _padded_rows(x: torch.Tensor, offsets: torch.Tensor, align: int):
    """(destination row of every row of x in the 16-aligned layout (dropped rows: the scratch row
    ``total``), total rows (static), offsets_pad [G] int32)."""
    groups, m = offsets.numel(), x.shape[0]
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + align - 1) // align * align
    ends_pad = torch.cumsum(padded, 0)
    rows = torch.arange(m, device=x.device)
    grp = torch.searchsorted(ends, rows, right=True)
    inside = grp < groups
    g = grp.clamp_max(groups - 1)
    total = -(-(m + groups * (align - 1)) // align) * align  # the transposed operand's rows: 16-byte strides
    # rows past the last group go past the last padded group (there is room: ends_pad[-1] <= ends[-1] + 15 G)
    past = ends_pad[-1] + rows - ends[-1]
    dest = torch.where(inside, (ends_pad - padded)[g] + rows - (ends - counts)[g], past)
    return dest, total, ends_pad.to(torch.int32)


def pad_groups(x: torch.Tensor, offsets: torch.Tensor, align: int = ALIGN):
    """Rows grouped by ``offsets[G]`` (cumulative ends; rows past the last end are dropped) ->
    (x_pad [round_up(M + G*(align-1), align), ...] with every group starting at a multiple of
    ``align`` and zeros between groups, offsets_pad [G] int32). No host sync (the size is a static
    bound)."""
    dest, total, offs_pad = _padded_rows(x, offsets, align)
    buf = x.new_zeros(total, *x.shape[1:])
    buf.index_copy_(0, dest, x)
    past = torch.arange(total, device=x.device) >= offs_pad[-1]
    return buf.masked_fill_(past.view(-1, *([1] * (x.dim() - 1))), 0), offs_pad


def pad_groups_t(x: torch.Tensor, offsets: torch.Tensor, align: int = ALIGN, tail: bool = True):
    """``pad_groups(x, offsets)[0].t().contiguous()`` in one copy: x [M, C] -> [C, total],
    offsets_pad. ``tail=False`` promises ``offsets[-1] == M`` (no row to drop: saves a pass)."""
    dest, total, offs_pad = _padded_rows(x, offsets, align)
    buf = x.new_zeros(x.shape[1], total)
    buf.index_copy_(1, dest, x.t())
    if tail:  # dropped rows landed past the last group: zero them (the rowwise amax reads every column)
        buf.masked_fill_(torch.arange(total, device=x.device) >= offs_pad[-1], 0)
    return buf, offs_pad


def _q_transposed(w: torch.Tensor):
    """Rowwise quantization of ``w[G, N, K].transpose(-2, -1)`` (scales over N) -> (q [G, K, N]
    contiguous, s [G, K]), one group at a time: the transient transposed copy is one expert's, not
    all experts' weights."""
    if tracing(w):  # inductor cannot lower copies into slices of an fp8 buffer: stack (same bits)
        parts = [_q(w[g].t()) for g in range(w.shape[0])]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1].view(-1) for p in parts])
    q = torch.empty(w.shape[0], w.shape[2], w.shape[1], dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(w.shape[0], w.shape[2], dtype=torch.float32, device=w.device)
    for g in range(w.shape[0]):
        qg, sg = _q(w[g].t())
        q[g].copy_(qg)
        s[g].copy_(sg.view(-1))
    return q, s


# ------------------------------------------------------------------------------ dense


class RowwiseLinear(torch.autograd.Function):
    """x [M, K], w [N, K] -> y [M, N] in x's dtype (see module doc)."""

    @staticmethod
    def forward(ctx, x, w):
        xq, xs = _q(x)
        wq, ws = _q(w)
        ctx.save_for_backward(x, w)
        return scaled_mm(xq, xs, wq, ws).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gq, gs = _q(dy)
            wtq, wts = _q(w.t())  # [K, N]: per input column over N
            dx = scaled_mm(gq, gs, wtq, wts).to(x.dtype)
        if ctx.needs_input_grad[1]:
            pad = (-x.shape[0]) % ALIGN  # the contraction (tokens) in 16s
            dyt = torch.nn.functional.pad(dy.t(), (0, pad))
            xt = torch.nn.functional.pad(x.t(), (0, pad))
            dw = scaled_mm(*_q(dyt), *_q(xt)).to(w.dtype)
        return dx, dw


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight [N, K].T`` with the rowwise recipe; inputs already checked."""
    return RowwiseLinear.apply(x, weight)


# ------------------------------------------------------------------------------ grouped


def grouped_forward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [G, N, K] -> bf16 [M, N] (per-token / per-output-row scales over K)."""
    xq, xs = _q(x)
    wq, ws = _q(w)
    return scaled_grouped_mm(xq, xs.view(-1), wq, ws.view(w.shape[0], w.shape[1]), offsets)


def grouped_dgrad(dy: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dy [M, N], w [G, N, K] -> bf16 dx [M, N] @ w[g] = [M, K] (scales over N)."""
    gq, gs = _q(dy)
    wtq, wts = _q_transposed(w)  # [G, K, N]
    return scaled_grouped_mm(gq, gs.view(-1), wtq, wts, offsets)


def grouped_wgrad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, tail: bool = True) -> torch.Tensor:
    """dy [M, N], x [M, K] -> bf16 dw [G, N, K], ``dw[g] = dy_g.T @ x_g`` (scales over the tokens);
    ``tail=False``: offsets[-1] == M."""
    groups = offsets.numel()
    dyt, offs_pad = pad_groups_t(dy, offsets, tail=tail)
    atq, ats = _q(dyt)
    del dyt
    xt, _ = pad_groups_t(x, offsets, tail=tail)
    btq, bts = _q(xt)
    del xt
    sat = ats.view(1, -1).expand(groups, -1).reshape(-1)
    sbt = bts.view(1, -1).expand(groups, -1).reshape(-1)
    return scaled_k_grouped_mm(atq, sat, btq, sbt, offs_pad)


class RowwiseGroupedLinear(torch.autograd.Function):
    """x [M, K], w [G, N, K], offsets [G] -> y [M, N] in x's dtype; rows past offsets[-1] zero."""

    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return grouped_forward(x, w, offsets).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_dgrad(dy, w, offsets).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = grouped_wgrad(dy, x, offsets).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def rowwise_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return RowwiseGroupedLinear.apply(x, weight, offsets)
