"""Chunked log-probabilities: the [T, V] logits are never materialised.

The driver walks vocabulary chunks (outer) and token chunks (inner). Each step computes one
``[Tc, Vc]`` float32 logits block with a matmul and hands it to the per-chunk work:

forward, per token, an online log-sum-exp over the vocabulary chunks seen so far:
    m   running max of z,     s = sum exp(z - m),     w = sum exp(z - m) (z - m)
    rescaled to a new max m' by a = exp(m - m'):  s' = a s,  w' = a (w + (m - m') s)
    at the end: lse = m + log s,  entropy = log s - w / s,  logp = z[target] - lse
(tracking w relative to the running max keeps the entropy free of the cancellation
``lse - E[z]`` would suffer when |z| is large and the entropy small).

backward, per element, with g = dL/dlogp and h = dL/dentropy, p = exp(z - lse), E[z] = lse - H:
    dL/dz = g (onehot - p) - h p (z - E[z]);   dL/dlogits = dL/dz / temperature
then grad_hidden += dlogits @ W_chunk and grad_weight_chunk += dlogits^T @ hidden_chunk.
Backward recomputes each logits block (one extra matmul) instead of storing anything [T, V].

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
    def forward_chunk(z, work, inv_temp, targets, v0, m, s, w, zt, with_entropy):
        tc, vc = z.shape
        z.mul_(inv_temp.unsqueeze(1))
        local = targets - v0
        inside = (local >= 0) & (local < vc)
        picked = z.gather(1, local.clamp(0, vc - 1).unsqueeze(1)).squeeze(1)
        zt.copy_(torch.where(inside, picked, zt))
        m_new = torch.maximum(m, z.amax(dim=1))
        a = torch.exp(m - m_new)
        d = z.sub_(m_new.unsqueeze(1))  # z - m', in place
        e = torch.exp(d, out=work)
        if with_entropy:
            w.copy_(a * (w + (m - m_new) * s) + d.mul_(e).sum(dim=1))
        s.copy_(a * s + e.sum(dim=1))
        m.copy_(m_new)

    @staticmethod
    def backward_chunk(z, work, inv_temp, targets, v0, lse, ez, g_lp, g_ent):
        tc, vc = z.shape
        it = inv_temp.unsqueeze(1)
        z.mul_(it)
        p = torch.sub(z, lse.unsqueeze(1), out=work).exp_()
        if g_ent is not None:
            dz = z.sub_(ez.unsqueeze(1)).mul_(p).mul_(-g_ent.unsqueeze(1))
            dz.addcmul_(p, g_lp.unsqueeze(1), value=-1.0)
        else:
            dz = z.copy_(p).mul_(-g_lp.unsqueeze(1))
        local = targets - v0
        inside = (local >= 0) & (local < vc)
        rows = inside.nonzero().squeeze(1)
        if rows.numel():
            dz[rows, local[rows]] += g_lp[rows]
        dz.mul_(it)


def _workspace(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    # Two flat buffers reused by every chunk: on CPU a fresh large allocation per chunk costs page
    # faults comparable to the chunk's arithmetic.
    return (torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.float32, device=device))


def _block(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return buf[: rows * cols].view(rows, cols)


def chunked_forward(hidden, weight, targets, inv_temp, chunk_size, vocab_chunk_size, with_entropy, ops):
    """-> (logprobs [T], entropy [T] (zeros when not asked), lse [T]), all float32."""
    T, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    m = torch.full((T,), M_INIT, dtype=torch.float32, device=dev)
    s = torch.zeros(T, dtype=torch.float32, device=dev)
    w = torch.zeros(T, dtype=torch.float32, device=dev)
    zt = torch.zeros(T, dtype=torch.float32, device=dev)
    tc_max, vc_max = min(chunk_size, T), min(vocab_chunk_size, V)
    buf_z, buf_w = _workspace(tc_max * vc_max, dev)
    for v0 in range(0, V, vocab_chunk_size):
        v1 = min(v0 + vocab_chunk_size, V)
        w_c = weight[v0:v1].float()
        for t0 in range(0, T, chunk_size):
            t1 = min(t0 + chunk_size, T)
            z = torch.mm(hidden[t0:t1].float(), w_c.t(), out=_block(buf_z, t1 - t0, v1 - v0))
            ops.forward_chunk(z, _block(buf_w, t1 - t0, v1 - v0), inv_temp[t0:t1], targets[t0:t1], v0,
                              m[t0:t1], s[t0:t1], w[t0:t1], zt[t0:t1], with_entropy)
    log_s = torch.log(s)
    lse = m + log_s
    entropy = log_s - w / s if with_entropy else torch.zeros_like(lse)
    return zt - lse, entropy, lse


def chunked_backward(hidden, weight, targets, inv_temp, lse, entropy, g_lp, g_ent, chunk_size,
                     vocab_chunk_size, need_hidden, need_weight, ops):
    """-> (grad_hidden [T, D] in hidden.dtype or None, grad_weight [V, D] in weight.dtype or None)."""
    T, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    ez = lse - entropy
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
            h = hidden[t0:t1].float()
            z = torch.mm(h, w_c.t(), out=_block(buf_z, t1 - t0, v1 - v0))
            ops.backward_chunk(z, _block(buf_w, t1 - t0, v1 - v0), inv_temp[t0:t1], targets[t0:t1], v0,
                               lse[t0:t1], ez[t0:t1], g_lp[t0:t1], None if g_ent is None else g_ent[t0:t1])
            if need_hidden:
                grad_h[t0:t1].addmm_(z, w_c)
            if need_weight:
                acc.addmm_(z.t(), h)
        if need_weight and grad_w.dtype != torch.float32:
            grad_w[v0:v1].copy_(acc)
    if grad_h is not None:
        grad_h = grad_h.to(hidden.dtype)
    return grad_h, grad_w


class ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, chunk_size, vocab_chunk_size, with_entropy, ops):
        logprobs, entropy, lse = chunked_forward(hidden, weight, targets, inv_temp, chunk_size,
                                                 vocab_chunk_size, with_entropy, ops)
        ctx.save_for_backward(hidden, weight, targets, inv_temp, lse, entropy)
        ctx.cfg = (chunk_size, vocab_chunk_size, with_entropy, ops)
        ctx.mark_non_differentiable(lse)
        return logprobs, entropy, lse

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_lse):
        hidden, weight, targets, inv_temp, lse, entropy = ctx.saved_tensors
        chunk_size, vocab_chunk_size, with_entropy, ops = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return (None,) * 8
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
        g_ent = None if (g_ent is None or not with_entropy) else g_ent.float().contiguous()
        grad_h, grad_w = chunked_backward(hidden, weight, targets, inv_temp, lse, entropy, g_lp, g_ent,
                                          chunk_size, vocab_chunk_size, need_h, need_w, ops)
        return grad_h, grad_w, None, None, None, None, None, None
