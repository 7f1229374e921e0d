"""Building blocks of the decoder over packed sequences: RMSNorm, rotary embedding (full or partial),
GQA attention and the dense SwiGLU MLP.

Shape legend: T tokens of a packed batch (all sequences concatenated), D model dim, H query heads,
Hkv key/value heads, Dh head dim, F dense FFN width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoETransformerConfig


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, normalised in float32 and cast back before the weight (as Hugging
    Face's Qwen3/GLM RMSNorm do, so bf16 results match theirs)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(in_dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rope_cos_sin(position_ids: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin ``[T, rotary_dim]`` for the rotate-half convention, computed in float32.

    The inverse frequencies are recomputed per call (``rotary_dim / 2`` numbers): no buffer to
    initialise after meta-device construction or to shard.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=position_ids.device)
                                / rotary_dim))
    freqs = position_ids.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x[T, H, Dh]``; the rest pass through (partial rotary)."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)


def _attention(q, k, v, cu_seqlens, softmax_scale, backend=None):
    from primerl.kernels.attention import attention

    return attention(q, k, v, cu_seqlens=cu_seqlens.to(torch.int32), causal=True, softmax_scale=softmax_scale,
                     backend=backend)


class Attention(nn.Module):
    """GQA self-attention over packed sequences, with optional q/k RMSNorm over the head dim and
    partial rotary embedding.

    ``project_qkv`` is exposed separately so that an inference engine can keep a KV cache:
    it returns the rotated ``q[T, H, Dh]`` and ``k, v[T, Hkv, Dh]``; ``forward`` runs attention
    over ``cu_seqlens`` and the output projection.
    """

    def __init__(self, config: MoETransformerConfig):
        super().__init__()
        c = config
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.rotary_dim, self.rope_theta = c.rotary_dim, c.rope_theta
        self.softmax_scale = c.head_dim ** -0.5
        self.q_proj = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=c.o_proj_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        # Set by parallelize() for context parallelism: fn(q, k, v, plan, *, causal, softmax_scale).
        self.context_attention = None
        self.config = c  # shared with the model: attn_backend is read at each forward

    def project_qkv(self, x: torch.Tensor, position_ids: torch.Tensor):
        """``x[T, D]``, ``position_ids[T]`` -> rotated ``q[T, H, Dh]``, ``k[T, Hkv, Dh]``, ``v[T, Hkv, Dh]``."""
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(position_ids, self.rotary_dim, self.rope_theta, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens) -> torch.Tensor:
        """``x[T, D]`` -> ``[T, D]``; ``cu_seqlens`` int32 ``[B+1]`` or a context-parallel shard plan."""
        q, k, v = self.project_qkv(x, position_ids)
        if self.context_attention is not None and not torch.is_tensor(cu_seqlens):
            o = self.context_attention(q, k, v, cu_seqlens, causal=True, softmax_scale=self.softmax_scale,
                                       backend=self.config.attn_backend)
        else:
            o = _attention(q, k, v, cu_seqlens, self.softmax_scale, self.config.attn_backend)
        return self.o_proj(o.reshape(x.shape[0], self.n_heads * self.head_dim))


class DenseMLP(nn.Module):
    """SwiGLU feed-forward ``down(silu(gate(x)) * up(x))``, ``x[T, D]`` -> ``[T, D]``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
