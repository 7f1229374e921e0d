"""The "cudnn" backend: cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention`` and its
``_backward``, what SDPA runs by default on Hopper) over runs of equal-length sequences. CUDA only.

cuDNN's varlen entry (``aten._cudnn_attention_forward`` with ``cum_seq_q/k``) exists in torch 2.11
but ran at 23 TF/s on the H200 (8 x 4096 tokens, 32/8 heads, D 128) against 626 for the dense call,
so the packed batch is cut as in the ``sdpa`` backend: each run of consecutive sequences with the
same (Lq, Lk) is a zero-copy ``[n, H, L, D]`` view and one call. GQA is native (Hkv < Hq).

What it covers: default positions with Lq == Lk per sequence when causal (cuDNN's ``is_causal`` is
top-left aligned, which equals our bottom-right rule only on square blocks), any lengths when not
causal; bf16/fp16, head_dim a multiple of 8 up to 128. ``backend=None`` takes it only when the batch
is a few runs (``MAX_RUNS``): a ragged batch would be one small call per sequence.

The backward takes an external out/lse (ring-merged blocks work). A gradient through lse goes to
the ``varlen_flash`` backward, which widens the head dim for it (see there): cuDNN's head-dim limit
leaves no room for that at D = 128.
"""

from __future__ import annotations

import functools

import torch

from . import varlen_flash
from .sdpa import _assemble, _fill_gaps_neg_inf, _heads_view

MAX_HEAD_DIM = 128
MAX_RUNS = 4  # backend=None picks cuDNN for at most this many runs of equal-length sequences


def runs(spec) -> list[tuple[int, int, int, int, int]]:
    """``(q_start, k_start, n, Lq, Lk)`` for each run of consecutive sequences of equal (Lq, Lk),
    from the host copy of cu_seqlens (no device sync). Sequences without queries or keys are left out."""
    cq, ck = spec.host_cu_q, spec.host_cu_k
    if not cq:  # a spec built by hand, without the host copy: read the offsets (a sync)
        cq, ck = spec.cu_seqlens_q.tolist(), spec.cu_seqlens_k.tolist()
    out: list[list[int]] = []
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if lq == 0 or lk == 0:
            out.append(None)
            continue
        last = out[-1] if out else None
        if last is not None and last[3] == lq and last[4] == lk:
            last[2] += 1
        else:
            out.append([cq[b], ck[b], 1, lq, lk])
    return [tuple(r) for r in out if r is not None]


@functools.lru_cache(maxsize=64)
def _static_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    if device.type != "cuda":
        return f"needs CUDA tensors, got {device.type}"
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return f"torch {torch.__version__} has no aten._scaled_dot_product_cudnn_attention"
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available to torch"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "cuDNN fused attention needs sm_80 or newer"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"cuDNN fused attention takes bf16/fp16, got {dtype}"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head_dim must be a multiple of 8 up to {MAX_HEAD_DIM}, got {head_dim}"
    return None


def unsupported_reason(q: torch.Tensor, spec) -> str | None:
    """Why this backend cannot compute the case (None: it can)."""
    reason = _static_reason(q.device, q.dtype, q.shape[-1])
    if reason is not None:
        return reason
    if spec.q_positions is not None:
        return "explicit q_positions/k_positions are not expressible"
    if spec.causal and any(lq != lk for _, _, _, lq, lk in runs(spec)):
        return "causal blocks must be square per sequence (Lq == Lk): cuDNN's causal mask is top-left aligned"
    return None


def forward(q, k, v, spec, out_dtype: torch.dtype):
    """q ``[T, Hq, D]``, k/v ``[Tk, Hkv, D]`` -> out ``[T, Hq, D]`` (out_dtype), lse ``[Hq, T]`` float32."""
    T, Hq, D = q.shape
    if T == 0 or k.shape[0] == 0:
        return (torch.zeros(T, Hq, D, dtype=out_dtype, device=q.device),
                torch.full((Hq, T), float("-inf"), dtype=torch.float32, device=q.device))
    outs, lses = [], []
    for qs, ks, n, lq, lk in runs(spec):
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _heads_view(q, qs, n, lq), _heads_view(k, ks, n, lk), _heads_view(v, ks, n, lk), None, True, 0.0,
            spec.causal, False, scale=spec.softmax_scale)
        # out is [n, H, L, D] over [n, L, H, D] memory (a view back to packed rows), lse [n, H, L, 1]
        outs.append((qs, res[0].transpose(1, 2).reshape(n * lq, Hq, D)))
        lses.append((qs, res[1].reshape(n, Hq, lq).transpose(0, 1).reshape(Hq, n * lq)))
    out = _assemble(outs, T, (Hq, D), out_dtype, q.device)
    lse = _assemble(lses, T, (Hq,), torch.float32, q.device, dim=1)
    return out, _fill_gaps_neg_inf(lse, lses, T)


def _single_token_backward(dout, q, k, v, out, lse, scale):
    """cuDNN's backward rejects Lq = Lk = 1 ("s_q = s_kv = 1 is not supported"); for a run of
    one-token sequences the block is one score per head: the same formulas in float32.
    dout/q/out ``[n, Hq, D]``, k/v ``[n, Hkv, D]``, lse ``[n, Hq]`` (+inf: no key)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    kq, vq = (t.float().repeat_interleave(hq // hkv, 1) for t in (k, v))
    do = dout.float()
    p = torch.exp((q.float() * kq).sum(-1) * scale - lse)
    ds = p * ((do * vq).sum(-1) - (do * out.float()).sum(-1))
    dq = ds[..., None] * kq * scale
    dk = (ds[..., None] * q.float() * scale).view(n, hkv, hq // hkv, d).sum(2)
    dv = (p[..., None] * do).view(n, hkv, hq // hkv, d).sum(2)
    return dq, dk, dv


def backward(dout, q, k, v, out, lse, dlse, spec):
    """Block gradients from a (possibly ring-merged) out/lse: dq ``[T, Hq, D]``, dk/dv ``[Tk, Hkv, D]``
    in q.dtype (cuDNN's; the public attention_backward widens them)."""
    if dlse is not None:
        return varlen_flash.backward(dout, q, k, v, out, lse, dlse, spec)
    T, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    dt = q.dtype
    if T == 0 or Tk == 0:
        return q.new_zeros(T, Hq, D), k.new_zeros(Tk, Hkv, D), k.new_zeros(Tk, Hkv, D)
    dout, out = dout.to(dt), out.to(dt)
    lse_safe = torch.where(torch.isneginf(lse), float("inf"), lse.float())  # rows that saw nothing: P = 0
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout 0: never read
    dqs, dks, dvs = [], [], []
    for qs, ks, n, lq, lk in runs(spec):
        if lq == 1 and lk == 1:
            dq, dk, dv = _single_token_backward(dout[qs:qs + n], q[qs:qs + n], k[ks:ks + n], v[ks:ks + n],
                                                out[qs:qs + n], lse_safe[:, qs:qs + n].t(), spec.softmax_scale)
            dqs.append((qs, dq))
            dks.append((ks, dk))
            dvs.append((ks, dv))
            continue
        lse_b = lse_safe[:, qs:qs + n * lq].reshape(Hq, n, lq).transpose(0, 1).unsqueeze(-1).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _heads_view(dout, qs, n, lq), _heads_view(q, qs, n, lq), _heads_view(k, ks, n, lk),
            _heads_view(v, ks, n, lk), _heads_view(out, qs, n, lq), lse_b, seed, seed, None, None, None, lq, lk,
            0.0, spec.causal, scale=spec.softmax_scale)
        if dk.shape[1] != Hkv:  # a cuDNN that expanded the k/v heads: sum each group back
            dk = dk.float().view(n, Hkv, Hq // Hkv, lk, D).sum(2)
            dv = dv.float().view(n, Hkv, Hq // Hkv, lk, D).sum(2)
        dqs.append((qs, dq.transpose(1, 2).reshape(n * lq, Hq, D)))
        dks.append((ks, dk.transpose(1, 2).reshape(n * lk, Hkv, D)))
        dvs.append((ks, dv.transpose(1, 2).reshape(n * lk, Hkv, D)))
    return (_assemble(dqs, T, (Hq, D), dt, q.device), _assemble(dks, Tk, (Hkv, D), dt, q.device),
            _assemble(dvs, Tk, (Hkv, D), dt, q.device))
