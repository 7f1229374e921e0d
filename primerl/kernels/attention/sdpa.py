"""The "sdpa" backend: torch's fused scaled-dot-product-attention kernels over packed sequences.

torch has no varlen SDPA, so the packed batch is cut into runs of consecutive sequences with the
same (Lq, Lk); each run is a zero-copy ``[n, H, L, D]`` view of q/k/v and goes to one kernel call
(a batch of equal-length sequences is a single call). The kernels take GQA directly (Hkv < Hq).

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): returns lse,
  and its backward takes an external out/lse, so the block backward of ring attention works.
- CUDA: ``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``), which takes an
  additive mask; k/v heads are repeated for GQA (that kernel has no GQA).

Masks: the kernels' ``is_causal`` is top-left aligned, which equals our rule only when Lq == Lk
with default positions. Otherwise (explicit positions, non-square causal) an additive float mask
is built per sequence from the positions (the visibility rule of ``reference``).

Gradient through lse: dS = P * (dP - rowsum(dout * out) + dlse). The kernels' backward has no
dlse input, so the head dim is augmented: v gets a column of ones, dout a column holding dlse,
out a zero column (q, k get zeros, leaving the scores unchanged); then the kernel's dP gains +dlse
while its rowsum is unchanged, which is exactly the extra term.

Precision: the kernels accumulate in float32 but return q.dtype; ``out_dtype=float32`` with
bf16 inputs is the bf16 result widened (the reference and Triton write float32 directly).
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def _groups(spec, T: int):
    """Yield (qs, ks, n, Lq, Lk, masked) runs: n consecutive sequences of equal lengths starting at
    query row qs and key row ks. ``masked`` is False when the kernel's own masking is exact for the
    run (default positions and either not causal or Lq == Lk); else the run is a single sequence
    that needs a built mask. Sequences without queries or keys are skipped (left to the caller).
    """
    cq, ck = spec.cu_seqlens_q.tolist(), spec.cu_seqlens_k.tolist()
    needs_mask_always = spec.q_positions is not None
    run = None  # [qs, ks, n, lq, lk]
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if lq == 0 or lk == 0:
            if run is not None:
                yield (*run, False)
                run = None
            continue
        masked = needs_mask_always or (spec.causal and lq != lk)
        if masked:
            if run is not None:
                yield (*run, False)
                run = None
            yield cq[b], ck[b], 1, lq, lk, True
            continue
        if run is not None and run[3] == lq and run[4] == lk:
            run[2] += 1
        else:
            if run is not None:
                yield (*run, False)
            run = [cq[b], ck[b], 1, lq, lk]
    if run is not None:
        yield (*run, False)


# A masked run goes to the kernel in blocks of query rows whose additive mask has at most this
# many elements: one [Lq, Lk] mask of a ring step over a 32k-token shard would be 4 GB in float32.
# With its boolean temporaries a block's mask costs ~7 bytes an element: 1M keeps it ~7 MB, small
# next to a long shard's activations (measured: 4M added ~28 MB per rank at 8192 tokens a rank).
MASK_ELEMENTS = 1 << 20


def _row_blocks(lq: int, lk: int, masked: bool):
    """``(first row, rows)`` blocks of a run: the whole run unless it needs a mask."""
    step = lq if not masked else max(1, min(lq, MASK_ELEMENTS // max(lk, 1)))
    return [(r, min(step, lq - r)) for r in range(0, lq, step)]


class _Masks:
    """Builds the additive masks of the runs that need one; positions computed once per call."""

    def __init__(self, spec):
        self.spec, self.pos = spec, None

    def __call__(self, qs, ks, lq, lk, dtype):
        """Additive mask ``[1, 1, lq, lk]`` (0 visible, -inf hidden) and the rows that see any key ``[lq]``."""
        if self.pos is None:
            self.pos = self.spec.positions()
        qp, kp = self.pos[0][qs:qs + lq].long(), self.pos[1][ks:ks + lk].long()
        vis = (kp >= 0)[None, :].expand(lq, lk)
        if self.spec.causal:
            vis = vis & (kp[None, :] <= qp[:, None])
        bias = torch.zeros(lq, lk, dtype=dtype, device=qp.device).masked_fill_(~vis, _NEG_INF)
        return bias[None, None], vis.any(-1)


def _heads_view(x, start, n, length):
    """Rows ``start .. start + n*length`` of a packed ``[T, H, D]`` as ``[n, H, length, D]`` (a view)."""
    return x[start:start + n * length].view(n, length, x.shape[1], x.shape[2]).transpose(1, 2)


def _cuda_bias(bias, n, h, lq, lk, dtype, device):
    # The efficient kernel wants the bias' last dim 16-aligned in memory and the batch/head dims
    # materialised: allocate padded, slice back (what SDPA's own mask preprocessing does).
    pad = (lk + 15) // 16 * 16
    full = torch.zeros(n, h, lq, pad, dtype=dtype, device=device)
    if bias is not None:
        full[..., :lk].copy_(bias.expand(n, h, lq, lk))
    return full[..., :lk]


def _kernel_forward(qb, kb, vb, causal, bias, scale):
    """[n, H, Lq, D] views -> out [n, H, Lq, D] (q dtype), lse [n, H, Lq] float32."""
    if qb.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qb, kb, vb, 0.0, causal, attn_mask=bias, scale=scale)
    g = qb.shape[1] // kb.shape[1]
    kb, vb = kb.repeat_interleave(g, 1), vb.repeat_interleave(g, 1)
    n, h, lq, _ = qb.shape
    if bias is not None:
        bias = _cuda_bias(bias, n, h, lq, kb.shape[2], qb.dtype, qb.device)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        qb, kb, vb, bias, True, 0.0, causal, scale=scale)
    return out, lse[..., :lq].float()


def _kernel_backward(dob, qb, kb, vb, ob, lseb, causal, bias, scale):
    """Returns dq [n, H, Lq, D'], dk/dv [n, Hkv, Lk, D'] (kernel dtype)."""
    if qb.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dob, qb, kb, vb, ob, lseb, 0.0, causal, attn_mask=bias, scale=scale)
    hkv = kb.shape[1]
    g = qb.shape[1] // hkv
    kr, vr = kb.repeat_interleave(g, 1), vb.repeat_interleave(g, 1)
    n, h, lq, _ = qb.shape
    lk = kb.shape[2]
    if bias is not None:
        bias = _cuda_bias(bias, n, h, lq, lk, qb.dtype, qb.device)
    lse_pad = torch.full((n, h, (lq + 31) // 32 * 32), float("inf"), dtype=torch.float32, device=qb.device)
    lse_pad[..., :lq] = lseb
    seed = torch.zeros((), dtype=torch.int64, device=qb.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dob, qb, kr, vr, bias, ob, lse_pad, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
    shape = (n, hkv, g, lk, dk.shape[-1])
    return dq, dk.float().view(shape).sum(2), dv.float().view(shape).sum(2)


def _append_cols(x, first, extra: int):
    """``[T, H, D]`` -> ``[T, H, D + extra]``: column D holds ``first`` (scalar or ``[T, H]``), the rest 0."""
    cols = x.new_zeros(*x.shape[:-1], extra)
    cols[..., 0] = first
    return torch.cat((x, cols), -1)


def _assemble(pieces, total: int, tail: tuple, dtype, device, dim: int = 0):
    """Concatenate (start, tensor) pieces along ``dim`` into ``total`` rows, zeros in the gaps
    (sequences with no queries or no keys). One piece covering everything is returned as is:
    no zero fill and no copy (fresh zeros cost first-touch page faults on CPU)."""
    parts, at = [], 0
    for start, t in pieces:
        if start > at:
            parts.append(torch.zeros(*_rows_shape(tail, start - at, dim), dtype=dtype, device=device))
        parts.append(t.to(dtype))
        at = start + t.shape[dim]
    if at < total:
        parts.append(torch.zeros(*_rows_shape(tail, total - at, dim), dtype=dtype, device=device))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _rows_shape(tail, rows, dim):
    return (rows, *tail) if dim == 0 else (*tail, rows)


def forward(q, k, v, spec, out_dtype: torch.dtype):
    """q ``[T, Hq, D]``, k/v ``[Tk, Hkv, D]`` -> out ``[T, Hq, D]`` (out_dtype), lse ``[Hq, T]`` float32."""
    T, Hq, D = q.shape
    outs, lses, masks = [], [], _Masks(spec)
    for qs0, ks, n, lq0, lk, masked in _groups(spec, T):
        for r, lq in _row_blocks(lq0, lk, masked):  # a masked run is one sequence (n == 1)
            qs = qs0 + r
            bias, seen = masks(qs, ks, lq, lk, q.dtype) if masked else (None, None)
            o, lse_part = _kernel_forward(_heads_view(q, qs, n, lq), _heads_view(k, ks, n, lk),
                                          _heads_view(v, ks, n, lk), spec.causal and not masked, bias,
                                          spec.softmax_scale)
            o = o.transpose(1, 2).reshape(n * lq, Hq, D)  # a view: the kernels write [n, L, H, D] memory
            lse_part = lse_part.transpose(0, 1).reshape(Hq, n * lq)
            if seen is not None and not bool(seen.all()):  # rows that see no key: out 0, lse -inf
                o = torch.where(seen[:, None, None], o, 0)
                lse_part = torch.where(seen[None, :], lse_part, _NEG_INF)
            outs.append((qs, o))
            lses.append((qs, lse_part))
    out = _assemble(outs, T, (Hq, D), out_dtype, q.device)
    lse = _assemble(lses, T, (Hq,), torch.float32, q.device, dim=1)
    return out, _fill_gaps_neg_inf(lse, lses, T)


def _fill_gaps_neg_inf(lse, pieces, T):
    """Rows of no group (their sequence has no keys) see nothing: lse -inf, not the zero filler."""
    covered = sum(t.shape[1] for _, t in pieces)
    if covered == T:
        return lse
    at = 0  # with gaps, lse is a fresh concatenation: writing into it is safe
    for start, t in pieces:
        lse[:, at:start] = _NEG_INF
        at = start + t.shape[1]
    lse[:, at:] = _NEG_INF
    return lse


def backward(dout, q, k, v, out, lse, dlse, spec):
    """Block gradients from a (possibly ring-merged) out/lse; dq ``[T, Hq, D]``, dk/dv ``[Tk, Hkv, D]`` float32."""
    T, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    dt = q.dtype
    dout, out = dout.to(dt), out.to(dt)
    if dlse is not None:  # augmented head dim (module docstring); CUDA's kernel wants D % 8 == 0
        extra = 1 if q.device.type == "cpu" else 8
        q, k, out = (_append_cols(x, 0.0, extra) for x in (q, k, out))
        v = _append_cols(v, 1.0, extra)
        dout = _append_cols(dout, dlse.transpose(0, 1), extra)
    # rows whose lse is -inf saw no key anywhere: P must be 0, so exp(s - (+inf)), never exp(-inf + inf)
    lse_safe = torch.where(torch.isneginf(lse), float("inf"), lse.float())
    dqs, dks, dvs, masks = [], [], [], _Masks(spec)
    for qs0, ks, n, lq0, lk, masked in _groups(spec, T):
        gk_run = gv_run = None
        for r, lq in _row_blocks(lq0, lk, masked):
            qs = qs0 + r
            bias = masks(qs, ks, lq, lk, dt)[0] if masked else None
            lseb = lse_safe[:, qs:qs + n * lq].reshape(Hq, n, lq).transpose(0, 1).contiguous()
            gq, gk, gv = _kernel_backward(
                _heads_view(dout, qs, n, lq), _heads_view(q, qs, n, lq), _heads_view(k, ks, n, lk),
                _heads_view(v, ks, n, lk), _heads_view(out, qs, n, lq), lseb, spec.causal and not masked, bias,
                spec.softmax_scale)
            dqs.append((qs, gq.transpose(1, 2).reshape(n * lq, Hq, -1)[..., :D]))
            gk = gk.transpose(1, 2).reshape(n * lk, Hkv, -1)[..., :D]
            gv = gv.transpose(1, 2).reshape(n * lk, Hkv, -1)[..., :D]
            # row blocks of one run share its keys: their dK/dV add up (in float32)
            gk_run = gk if gk_run is None else gk_run.float() + gk
            gv_run = gv if gv_run is None else gv_run.float() + gv
        dks.append((ks, gk_run))
        dvs.append((ks, gv_run))
    f32 = torch.float32
    return (_assemble(dqs, T, (Hq, D), f32, q.device), _assemble(dks, Tk, (Hkv, D), f32, q.device),
            _assemble(dvs, Tk, (Hkv, D), f32, q.device))
