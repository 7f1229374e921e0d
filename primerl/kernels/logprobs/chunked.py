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
g (1 - p) = -g expm1(logp) (no cancellation when p -> 1); then grad_hidden += dz @ W_chunk and
grad_weight_chunk += dz^T @ hidden_chunk. Backward recomputes each logits block (one extra
matmul) instead of storing anything [T, V]: four GEMMs of 2 T D V flops each in all.

Two precisions of the matmuls:
- float32 operands (float32 inputs, mixed input dtypes): float32 GEMMs; the temperature scales the
  [Tc, D] hidden rows before the matmul (z = (h / tau) . W) rather than the [Tc, Vc] logits, which
  saves two passes over every block in the plain-PyTorch chunk ops.
- bf16/fp16 operands (both inputs of that dtype): tensor-core GEMMs with float32 accumulation and a
  float32 logits block (cuBLAS ``out_dtype=torch.float32``; on CPU, which has no such kernel, the
  operands are upcast: products of bf16 values are exact in float32, so the math is the same up to
  summation order). Rounding h / tau to bf16 would cost accuracy, so the chunk ops scale z by 1/tau
  in float32 instead (free inside the fused Triton pass). The gradient block dz is computed in
  float32 and rounded once to the operand dtype for the two gradient GEMMs, whose results
  accumulate in float32 ([T, D] for grad_hidden across vocabulary chunks, [Vc, D] for a weight
  chunk across token chunks) and are rounded to the input dtype once at the end.

The per-chunk work is pluggable (`TorchChunkOps` here, `triton.TritonChunkOps`), the matmuls are
torch's. Peak extra memory in backward: the [T, D] float32 grad_hidden accumulator plus the larger
of (a) the blocks: a [Tc, Vc] float32 block and a [Tc, Vc] gradient block (the same buffer for
float32 operands), a [Vc, D] float32 weight-gradient accumulator (none when one token chunk covers
T), and (b) grad_hidden rounded to bf16/fp16 (made after the blocks are released); a few [T] vectors.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..._kernel_sizes import default_chunk_sizes  # noqa: F401 - the kernels' choice, modelled by the plan

# A finite "minus infinity" for the running max: exp(M_INIT - m) underflows to 0 like -inf would,
# but (M_INIT - m) * 0 stays 0 instead of NaN in the entropy rescale.
M_INIT = -1.0e30

LOW_PRECISION = (torch.bfloat16, torch.float16)


class TorchChunkOps:
    """Per-chunk work in plain PyTorch ops (in place on the logits block where possible).

    ``inv_temp`` [Tc] (or None) scales the raw GEMM output z before anything else, and the
    gradient by the same factor (d(z * s)/dz = s)."""

    needs_work = True  # a second [Tc, Vc] float32 buffer

    @staticmethod
    def forward_chunk(z, work, targets, v0, m, r, w, zt, with_entropy, inv_temp=None):
        tc, vc = z.shape
        if inv_temp is not None:
            z.mul_(inv_temp.unsqueeze(1))
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
    def backward_chunk(z, work, dz_out, targets, v0, m, ls, c, g_lp, g_ent, tgt_grad, inv_temp=None):
        """dz_out [Tc, Vc] (z itself, or a buffer of the GEMM operand dtype) <- dL/dz_raw."""
        tc, vc = z.shape
        if inv_temp is not None:
            z.mul_(inv_temp.unsqueeze(1))
        d = z.sub_(m.unsqueeze(1))  # z - m, exact near the maximum
        p = torch.sub(d, ls.unsqueeze(1), out=work).exp_()
        if g_ent is not None:
            # dz = -p (g + h (z - E[z])) with z - E[z] = (z - m) + (m - E[z]) = d + c
            dz = torch.addcmul(-g_lp.unsqueeze(1), d.add_(c.unsqueeze(1)), -g_ent.unsqueeze(1), out=z).mul_(p)
        else:
            dz = torch.mul(p, -g_lp.unsqueeze(1), out=z)
        local = targets - v0
        inside = (local >= 0) & (local < vc)
        # the target element of each row whose target lies in this chunk (no nonzero: no host read)
        col = local.clamp(0, vc - 1).unsqueeze(1)
        dz.scatter_(1, col, torch.where(inside, tgt_grad, dz.gather(1, col).squeeze(1)).unsqueeze(1))
        if inv_temp is not None:
            dz.mul_(inv_temp.unsqueeze(1))
        if dz_out is not z:
            dz_out.copy_(dz)


@functools.lru_cache(maxsize=None)
def has_mm_out_dtype(device_type: str = "cuda") -> bool:
    """torch.mm / torch.addmm run with ``out_dtype=torch.float32`` on bf16 operands on this device
    type (CUDA in torch >= 2.8; no CPU kernel). Probed once with 8 x 8 tensors there: a meta probe
    is not enough (torch 2.11 computes it on CUDA but fails it on meta)."""
    try:
        a = torch.zeros(8, 8, dtype=torch.bfloat16, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(torch.zeros(8, 8, device=device_type), a, a, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def native_low_precision(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the GEMMs run on bf16/fp16 operands with a float32 result on this device."""
    if hidden.dtype != weight.dtype or hidden.dtype not in LOW_PRECISION or hidden.device.type != "cuda":
        return False
    if not has_mm_out_dtype(hidden.device.type):
        warnings.warn(f"fused_logprobs: torch {torch.__version__} has no torch.mm(..., out_dtype=torch.float32); "
                      "the logits GEMMs run in float32 (about 10x slower on tensor-core GPUs)", stacklevel=3)
        return False
    return True


def _gemm(out, a, b, accumulate=False):
    """out (+)= a @ b. out float32 with operands float32 or (CUDA) bf16/fp16; or out bf16/fp16
    without accumulation (operands of that dtype on CUDA, float32 upcasts on CPU)."""
    if out.dtype == torch.float32 and a.dtype != torch.float32:
        if accumulate:
            return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    if out.dtype == a.dtype:
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    assert not accumulate
    return out.copy_(torch.mm(a, b))


def _block(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return buf[: rows * cols].view(rows, cols)


def _low_precision_operands(hidden, weight) -> bool:
    return hidden.dtype == weight.dtype and hidden.dtype in LOW_PRECISION


class _Operands:
    """How the GEMM operands are made from hidden / weight / dz, for one of the two precisions."""

    def __init__(self, hidden, weight, inv_temp, unit_temp):
        self.lowp = _low_precision_operands(hidden, weight)
        self.native = self.lowp and native_low_precision(hidden, weight)
        self.dtype = hidden.dtype if self.lowp else torch.float32  # of the gradient block dz
        self.hidden, self.inv_temp, self.unit_temp = hidden, inv_temp, unit_temp
        # the chunk ops scale z only when the rows are not scaled (bf16/fp16 operands)
        self.kernel_temp = None if (unit_temp or not self.lowp) else inv_temp

    def rows(self, t0, t1):
        h = self.hidden[t0:t1]
        if self.native:
            return h
        h = h.float()
        if self.lowp or self.unit_temp:
            return h
        return h * self.inv_temp[t0:t1].unsqueeze(1)

    def cast(self, x):
        """A weight chunk or a gradient block as a GEMM operand."""
        return x if (self.native or x.dtype == torch.float32) else x.float()


def chunked_forward(hidden, weight, targets, inv_temp, unit_temp, chunk_size, vocab_chunk_size, with_entropy, ops):
    """-> (logprobs [T], entropy [T] (zeros when not asked), lse [T]), all float32."""
    T, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    opnd = _Operands(hidden, weight, inv_temp, unit_temp)
    m = torch.full((T,), M_INIT, dtype=torch.float32, device=dev)
    r = torch.full((T,), -1.0, dtype=torch.float32, device=dev)  # s = 1 + r = 0: nothing seen yet
    w = torch.zeros(T, dtype=torch.float32, device=dev)
    zt = torch.zeros(T, dtype=torch.float32, device=dev)
    tc_max, vc_max = min(chunk_size, T), min(vocab_chunk_size, V)
    buf_z = torch.empty(tc_max * vc_max, dtype=torch.float32, device=dev)
    buf_w = torch.empty(tc_max * vc_max, dtype=torch.float32, device=dev) if ops.needs_work else None
    for v0 in range(0, V, vocab_chunk_size):
        v1 = min(v0 + vocab_chunk_size, V)
        w_c = opnd.cast(weight[v0:v1])
        for t0 in range(0, T, chunk_size):
            t1 = min(t0 + chunk_size, T)
            z = _gemm(_block(buf_z, t1 - t0, v1 - v0), opnd.rows(t0, t1), w_c.t())
            ops.forward_chunk(z, None if buf_w is None else _block(buf_w, t1 - t0, v1 - v0), targets[t0:t1], v0,
                              m[t0:t1], r[t0:t1], w[t0:t1], zt[t0:t1], with_entropy,
                              None if opnd.kernel_temp is None else opnd.kernel_temp[t0:t1])
    ls = torch.log1p(r)
    logprobs = (zt - m) - ls
    if with_entropy:
        c = -w / (1 + r)  # m - E[z] >= 0
        entropy = ls + c
    else:
        c = entropy = torch.zeros_like(m)
    return logprobs, entropy, (m, ls, c)


def chunked_backward(hidden, weight, targets, inv_temp, unit_temp, logprobs, entropy, stats, g_lp, g_ent,
                     chunk_size, vocab_chunk_size, grad_chunk_size, need_hidden, need_weight, ops):
    """-> (grad_hidden [T, D] in hidden.dtype or None, grad_weight [V, D] in weight.dtype or None).

    The gradient blocks dz [grad_chunk_size, Vc] are filled logits block by logits block
    ([chunk_size, Vc]), then feed grad_hidden += dz @ W_c and grad_weight_c (+)= dz^T @ h.
    The blocks are released before the float32 grad_hidden is rounded to hidden's dtype, so the
    peak is the larger of (accumulator + blocks) and (accumulator + the rounded copy), not both."""
    grad_h, grad_w = _backward_blocks(hidden, weight, targets, inv_temp, unit_temp, logprobs, entropy, stats, g_lp,
                                      g_ent, chunk_size, vocab_chunk_size, grad_chunk_size, need_hidden, need_weight,
                                      ops)
    if grad_h is not None:
        if not unit_temp and not _low_precision_operands(hidden, weight):
            grad_h.mul_(inv_temp.unsqueeze(1))  # the float32 path scaled the rows, not the logits
        grad_h = grad_h.to(hidden.dtype)
    return grad_h, grad_w


def _backward_blocks(hidden, weight, targets, inv_temp, unit_temp, logprobs, entropy, stats, g_lp, g_ent,
                     chunk_size, vocab_chunk_size, grad_chunk_size, need_hidden, need_weight, ops):
    """The block loop of `chunked_backward`: -> (grad_hidden [T, D] float32, unscaled for float32
    operands, or None; grad_weight [V, D] or None). Every block buffer dies with this frame."""
    T, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    opnd = _Operands(hidden, weight, inv_temp, unit_temp)
    m, ls, c = stats
    tgt_grad = -g_lp * torch.expm1(logprobs)
    if g_ent is not None:
        tgt_grad = tgt_grad - g_ent * torch.exp(logprobs) * (logprobs + entropy)
    td_max, vc_max = min(grad_chunk_size, T), min(vocab_chunk_size, V)
    tz_max = min(chunk_size, td_max)
    # the gradient block is the logits block itself (in place) for float32 operands of equal chunks
    in_place = not opnd.lowp and tz_max == td_max
    grad_h = torch.empty(T, D, dtype=torch.float32, device=dev) if need_hidden else None
    grad_w = None
    if need_weight:
        grad_w = (torch.empty if T else torch.zeros)(V, D, dtype=weight.dtype, device=dev)
    # the weight gradient of a vocabulary chunk sums over gradient blocks: in float32 (grad_w itself
    # when float32); with a single gradient block one GEMM writes it directly
    gw_acc = None
    if need_weight and grad_chunk_size < T and grad_w.dtype != torch.float32:
        gw_acc = torch.empty(vc_max, D, dtype=torch.float32, device=dev)
    buf_z = torch.empty(tz_max * vc_max, dtype=torch.float32, device=dev)
    buf_w = torch.empty(tz_max * vc_max, dtype=torch.float32, device=dev) if ops.needs_work else None
    buf_dz = None if in_place else torch.empty(td_max * vc_max, dtype=opnd.dtype, device=dev)
    for v0 in range(0, V, vocab_chunk_size):
        v1 = min(v0 + vocab_chunk_size, V)
        w_c = opnd.cast(weight[v0:v1])
        if need_weight:
            gw = grad_w[v0:v1] if gw_acc is None else gw_acc[: v1 - v0]
        for d0 in range(0, T, grad_chunk_size):
            d1 = min(d0 + grad_chunk_size, T)
            dz_block = None if in_place else _block(buf_dz, d1 - d0, v1 - v0)
            for t0 in range(d0, d1, chunk_size):
                t1 = min(t0 + chunk_size, d1)
                h = opnd.rows(t0, t1)
                z = _gemm(_block(buf_z, t1 - t0, v1 - v0), h, w_c.t())
                if in_place:
                    dz_block = z
                ops.backward_chunk(z, None if buf_w is None else _block(buf_w, t1 - t0, v1 - v0),
                                   z if in_place else dz_block[t0 - d0: t1 - d0], targets[t0:t1], v0,
                                   m[t0:t1], ls[t0:t1], c[t0:t1], g_lp[t0:t1], None if g_ent is None else g_ent[t0:t1],
                                   tgt_grad[t0:t1], None if opnd.kernel_temp is None else opnd.kernel_temp[t0:t1])
            dz = opnd.cast(dz_block)
            if need_hidden:
                _gemm(grad_h[d0:d1], dz, w_c, accumulate=v0 > 0)
            if need_weight:
                # one logits block per gradient block: its rows are these
                _gemm(gw, dz.t(), h if t0 == d0 else opnd.rows(d0, d1), accumulate=d0 > 0)
        if gw_acc is not None:
            grad_w[v0:v1].copy_(gw_acc[: v1 - v0])
    return grad_h, grad_w
