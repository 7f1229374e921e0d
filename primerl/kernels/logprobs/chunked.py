"""Chunked log-probabilities: the [T, V] logits are never materialised.

The driver walks vocabulary chunks (outer) and token chunks (inner). Each step computes one
``[Tc, Vc]`` float32 logits block with a matmul and hands it to the per-chunk work:

forward, per token, an online log-sum-exp over the vocabulary chunks seen so far:
    m   running max of z,   r = sum exp(z - m) - 1 (the max's own term left out, so s = 1 + r),
    w = sum exp(z - m) (z - m)  (<= 0)
    rescaled to a new max m' by a = exp(m - m'):  w' = a (w + (m - m') (1 + r)); r' = r plus the
    new terms when the max stays, else the chunk's rest plus a (1 + r)
    at the end: lse = m + log1p(r),  logp = (z[target] - m) - log1p(r),  entropy = log1p(r) - w / (1 + r)
Keeping the max's exact 1 out of r and w relative to the max makes every final term accurate to
float32 rounding of its own size: a peaked distribution's entropy (1e-3, say) comes out with a
small relative error instead of an absolute error of ulp(1) or ulp(|z|).

backward, per element, with g = dL/dlogp and h = dL/dentropy, p = exp(z - lse), E[z] = lse - H:
    dL/dz = g onehot - p (g + h (z - E[z]))
with z - E[z] = (z - m) + (m - E[z]) = (z - m) - w / (1 + r) and, at the target,
g (1 - p) = -g expm1(logp) (no cancellation when p -> 1); then grad_hidden += dz @ W_chunk (times 1/temperature once at the end) and
grad_weight_chunk += dz^T @ (hidden_chunk / temperature).
The temperature scales the [Tc, D] hidden rows before the matmul (z = (h / tau) . W) rather than
the [Tc, Vc] logits, which saves two passes over every logits block. Backward recomputes each
logits block (one extra matmul) instead of storing anything [T, V].

The per-chunk work is pluggable (`TorchChunkOps` here, `triton.TritonChunkOps`), the matmuls are
torch's. Peak extra memory: two [Tc, Vc] float32 buffers, grad buffers, a few [T] vectors.
"""

from __future__ import annotations

import torch

# A finite "minus infinity" for the running max: exp(M_INIT - m) underflows to 0 like -inf would,
# but (M_INIT - m) * 0 stays 0 instead of NaN in the entropy rescale.
M_INIT = -1.0e30


class TorchChunkOps:
    """Per-chunk work in plain PyTorch ops (in place on the logits block where possible)."""

    @staticmethod
    def forward_chunk(z, work, targets, v0, m, r, w, zt, with_entropy):
        tc, vc = z.shape
        local = targets - v0
        inside = (local >= 0) & (local < vc)
        picked = z.gather(1, local.clamp(0, vc - 1).unsqueeze(1)).squeeze(1)
        zt.copy_(torch.where(inside, picked, zt))
        c_max, c_arg = z.max(dim=1)
        new_max = c_max > m  # strictly: on a tie the old maximum keeps the excluded "1"
        m_new = torch.where(new_max, c_max, m)
        a = torch.exp(m - m_new)
        d = z.sub_(m_new.unsqueeze(1))  # z - m', in place
        e = torch.exp(d, out=work)
        rows = torch.arange(tc, device=z.device)
        e[rows, c_arg] -= new_max.to(e.dtype)  # exp(0) - 1 = 0 exactly at the new maximum
        if with_entropy:
            # row-wise dot as a batched GEMV: one read of e and d, no [Tc, Vc] product temporary
            w.copy_(a * (w + (m - m_new) * (1 + r)) + torch.bmm(e.unsqueeze(1), d.unsqueeze(2)).view(tc))
        rest = e.sum(dim=1)
        r.copy_(torch.where(new_max, rest + a * (1 + r), r + rest))
        m.copy_(m_new)

    @staticmethod
    def backward_chunk(z, work, targets, v0, m, ls, c, g_lp, g_ent, tgt_grad):
        tc, vc = z.shape
        d = z.sub_(m.unsqueeze(1))  # z - m, exact near the maximum
        p = torch.sub(d, ls.unsqueeze(1), out=work).exp_()
        if g_ent is not None:
            # dz = -p (g + h (z - E[z])) with z - E[z] = (z - m) + (m - E[z]) = d + c
            dz = torch.addcmul(-g_lp.unsqueeze(1), d.add_(c.unsqueeze(1)), -g_ent.unsqueeze(1), out=z).mul_(p)
        else:
            dz = torch.mul(p, -g_lp.unsqueeze(1), out=z)
        local = targets - v0
        inside = (local >= 0) & (local < vc)
        rows = inside.nonzero().squeeze(1)
        if rows.numel():
            dz[rows, local[rows]] = tgt_grad[rows]


def _workspace(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    # Two flat buffers reused by every chunk: on CPU a fresh large allocation per chunk costs page
    # faults comparable to the chunk's arithmetic.
    return (torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.float32, device=device))


def _block(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return buf[: rows * cols].view(rows, cols)


def _scaled_rows(hidden, inv_temp, t0, t1, unit_temp):
    h = hidden[t0:t1].float()
    return h if unit_temp else h * inv_temp[t0:t1].unsqueeze(1)


def chunked_forward(hidden, weight, targets, inv_temp, unit_temp, chunk_size, vocab_chunk_size, with_entropy, ops):
    """-> (logprobs [T], entropy [T] (zeros when not asked), lse [T]), all float32."""
    T, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    m = torch.full((T,), M_INIT, dtype=torch.float32, device=dev)
    r = torch.full((T,), -1.0, dtype=torch.float32, device=dev)  # s = 1 + r = 0: nothing seen yet
    w = torch.zeros(T, dtype=torch.float32, device=dev)
    zt = torch.zeros(T, dtype=torch.float32, device=dev)
    tc_max, vc_max = min(chunk_size, T), min(vocab_chunk_size, V)
    buf_z, buf_w = _workspace(tc_max * vc_max, dev)
    for v0 in range(0, V, vocab_chunk_size):
        v1 = min(v0 + vocab_chunk_size, V)
        w_c = weight[v0:v1].float()
        for t0 in range(0, T, chunk_size):
            t1 = min(t0 + chunk_size, T)
            h = _scaled_rows(hidden, inv_temp, t0, t1, unit_temp)
            z = torch.mm(h, w_c.t(), out=_block(buf_z, t1 - t0, v1 - v0))
            ops.forward_chunk(z, _block(buf_w, t1 - t0, v1 - v0), targets[t0:t1], v0,
                              m[t0:t1], r[t0:t1], w[t0:t1], zt[t0:t1], with_entropy)
    ls = torch.log1p(r)
    logprobs = (zt - m) - ls
    if with_entropy:
        c = -w / (1 + r)  # m - E[z] >= 0
        entropy = ls + c
    else:
        c = entropy = torch.zeros_like(m)
    return logprobs, entropy, (m, ls, c)


def chunked_backward(hidden, weight, targets, inv_temp, unit_temp, logprobs, entropy, stats, g_lp, g_ent,
                     chunk_size, vocab_chunk_size, need_hidden, need_weight, ops):
    """-> (grad_hidden [T, D] in hidden.dtype or None, grad_weight [V, D] in weight.dtype or None)."""
    T, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    m, ls, c = stats
    tgt_grad = -g_lp * torch.expm1(logprobs)
    if g_ent is not None:
        tgt_grad = tgt_grad - g_ent * torch.exp(logprobs) * (logprobs + entropy)
    grad_h = torch.zeros(T, D, dtype=torch.float32, device=dev) if need_hidden else None
    grad_w = torch.zeros(V, D, dtype=weight.dtype, device=dev) if need_weight else None
    gw_acc = torch.zeros(min(vocab_chunk_size, V), D, dtype=torch.float32, device=dev) if need_weight else None
    tc_max, vc_max = min(chunk_size, T), min(vocab_chunk_size, V)
    buf_z, buf_w = _workspace(tc_max * vc_max, dev)
    for v0 in range(0, V, vocab_chunk_size):
        v1 = min(v0 + vocab_chunk_size, V)
        w_c = weight[v0:v1].float()
        if need_weight:
            acc = grad_w[v0:v1] if grad_w.dtype == torch.float32 else gw_acc[: v1 - v0].zero_()
        for t0 in range(0, T, chunk_size):
            t1 = min(t0 + chunk_size, T)
            h = _scaled_rows(hidden, inv_temp, t0, t1, unit_temp)
            z = torch.mm(h, w_c.t(), out=_block(buf_z, t1 - t0, v1 - v0))
            ops.backward_chunk(z, _block(buf_w, t1 - t0, v1 - v0), targets[t0:t1], v0, m[t0:t1], ls[t0:t1],
                               c[t0:t1], g_lp[t0:t1], None if g_ent is None else g_ent[t0:t1], tgt_grad[t0:t1])
            if need_hidden:
                grad_h[t0:t1].addmm_(z, w_c)
            if need_weight:
                acc.addmm_(z.t(), h)
        if need_weight and grad_w.dtype != torch.float32:
            grad_w[v0:v1].copy_(acc)
    if grad_h is not None:
        if not unit_temp:
            grad_h.mul_(inv_temp.unsqueeze(1))
        grad_h = grad_h.to(hidden.dtype)
    return grad_h, grad_w


class ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, unit_temp, chunk_size, vocab_chunk_size, with_entropy, ops):
        logprobs, entropy, (m, ls, c) = chunked_forward(hidden, weight, targets, inv_temp, unit_temp, chunk_size,
                                                        vocab_chunk_size, with_entropy, ops)
        ctx.save_for_backward(hidden, weight, targets, inv_temp, logprobs, entropy, m, ls, c)
        ctx.cfg = (unit_temp, chunk_size, vocab_chunk_size, with_entropy, ops)
        # an unused output (typically the entropy, logged only) then arrives as None, not zeros
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, inv_temp, logprobs, entropy, m, ls, c = ctx.saved_tensors
        unit_temp, chunk_size, vocab_chunk_size, with_entropy, ops = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w) or (g_lp is None and (g_ent is None or not with_entropy)):
            return (None,) * 9
        g_lp = torch.zeros_like(m) if g_lp is None else g_lp.float().contiguous()
        g_ent = None if (g_ent is None or not with_entropy) else g_ent.float().contiguous()
        grad_h, grad_w = chunked_backward(hidden, weight, targets, inv_temp, unit_temp, logprobs, entropy, (m, ls, c),
                                          g_lp, g_ent, chunk_size, vocab_chunk_size, need_h, need_w, ops)
        return grad_h, grad_w, None, None, None, None, None, None, None
