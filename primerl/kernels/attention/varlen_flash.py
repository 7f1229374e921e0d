"""The "varlen_flash" backend: the Flash Attention 2 kernels bundled with torch, called on the packed
batch directly (``aten._flash_attention_forward`` / ``_backward`` with ``cum_seq_q/k``). CUDA only.

What it covers: default positions (FA2's causal mask is bottom-right aligned per sequence, which is
our default rule, also for Lq != Lk), GQA without repeating k/v (FA2 takes Hkv < Hq), bf16/fp16,
head_dim a multiple of 8 up to 256. Explicit positions are not expressible: ``unsupported_reason``
says so and ``backend=None`` picks another backend.

The backward takes an external out/lse, so a block's gradients from a ring-merged out/lse work as
with the other backends. A query that sees no key comes back with lse = +inf from FA2; the public
contract is -inf (mapped here), and for the backward -inf is mapped back to +inf (P = 0).

Gradient through lse: dS = P * (dP - rowsum(dout * out) + dlse). FA2's backward has no dlse input,
so the head dim is widened by 8 (FA2 wants multiples of 8): v gets a column of ones, dout a column
holding dlse, q/k/out zero columns. Then dP gains +dlse, the rowsum and the scores are unchanged.
That runs FA2's next head-dim kernel (measured on the H200 at D=128: backward 18 ms instead of
9.9 ms at 8 x 4096 tokens, 32/8 heads), so it is only done when a dlse is given.

Precision: FA2 accumulates in float32 and returns out and the gradients in q.dtype; the float32
outputs of ``attention_forward(out_dtype=float32)`` / ``attention_backward`` are those values
widened. Inside autograd the gradients stay in q.dtype (no float32 round trip).
"""

from __future__ import annotations

import functools

import torch

MAX_HEAD_DIM = 256
_LSE_PAD = 8


@functools.lru_cache(maxsize=64)
def _static_reason(device: torch.device, dtype: torch.dtype, head_dim: int, dlse: bool) -> str | None:
    if device.type != "cuda":
        return f"needs CUDA tensors, got {device.type}"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return f"torch {torch.__version__} has no aten._flash_attention_forward"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "Flash Attention 2 needs sm_80 or newer"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"Flash Attention 2 takes bf16/fp16, got {dtype}"
    limit = MAX_HEAD_DIM - (_LSE_PAD if dlse else 0)
    if head_dim % 8 or head_dim > limit:
        note = " (with a gradient through lse)" if dlse else ""
        return f"head_dim must be a multiple of 8 up to {limit}{note}, got {head_dim}"
    return None


def unsupported_reason(q: torch.Tensor, spec, dlse: bool = False) -> str | None:
    """Why this backend cannot compute the case (None: it can)."""
    reason = _static_reason(q.device, q.dtype, q.shape[-1], bool(dlse))
    if reason is not None:
        return reason
    if spec.q_positions is not None:
        return ("explicit q_positions/k_positions are not expressible "
                "(FA2's mask is the default bottom-right causal one)")
    return None


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def forward(q, k, v, spec, out_dtype: torch.dtype):
    """q ``[T, Hq, D]``, k/v ``[Tk, Hkv, D]`` -> out ``[T, Hq, D]`` (out_dtype), lse ``[Hq, T]`` float32."""
    T, Hq, D = q.shape
    if T == 0 or k.shape[0] == 0:
        return (torch.zeros(T, Hq, D, dtype=out_dtype, device=q.device),
                torch.full((Hq, T), float("-inf"), dtype=torch.float32, device=q.device))
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        _contig(q), _contig(k), _contig(v), spec.cu_seqlens_q, spec.cu_seqlens_k, max(spec.max_seqlen_q, 1),
        max(spec.max_seqlen_k, 1), 0.0, spec.causal, False, scale=spec.softmax_scale)
    lse = lse.masked_fill_(lse == float("inf"), float("-inf"))  # rows that saw no key
    return out.to(out_dtype), lse


def _widen(x: torch.Tensor, first) -> torch.Tensor:
    """``[T, H, D]`` -> ``[T, H, D + 8]``: column D holds ``first`` (scalar or ``[T, H]``), the rest 0."""
    cols = x.new_zeros(*x.shape[:-1], _LSE_PAD)
    cols[..., 0] = first
    return torch.cat((x, cols), -1)


def backward(dout, q, k, v, out, lse, dlse, spec):
    """Block gradients from a (possibly ring-merged) out/lse: dq ``[T, Hq, D]``, dk/dv ``[Tk, Hkv, D]``
    in q.dtype (FA2's; the public attention_backward widens them)."""
    T, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    if T == 0 or Tk == 0:
        z = dict(dtype=q.dtype, device=q.device)
        return torch.zeros(T, Hq, D, **z), torch.zeros(Tk, Hkv, D, **z), torch.zeros(Tk, Hkv, D, **z)
    dt = q.dtype
    q, k, v, out, dout = (_contig(x.to(dt)) for x in (q, k, v, out, dout))
    lse = torch.where(torch.isneginf(lse), float("inf"), lse.float()).contiguous()
    if dlse is not None:
        q, k, out = (_widen(x, 0.0) for x in (q, k, out))
        v = _widen(v, 1.0)
        dout = _widen(dout, dlse.transpose(0, 1).to(dt))
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout 0: never read
    unused = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, spec.cu_seqlens_q, spec.cu_seqlens_k, max(spec.max_seqlen_q, 1),
        max(spec.max_seqlen_k, 1), 0.0, spec.causal, rng_state, unused, scale=spec.softmax_scale)
    if dlse is None:
        return dq, dk, dv
    return dq[..., :D], dk[..., :D], dv[..., :D]
