"""Attention over packed variable-length sequences that returns the log-sum-exp, its backward,
and the merge of partial attention results (the pieces ring attention is built from).

Layout (flash-attn's varlen convention): q ``[T, Hq, D]``, k/v ``[Tk, Hkv, D]`` hold B sequences
back to back, ``cu_seqlens`` int32 ``[B+1]`` their offsets (``None``: one sequence). GQA when
Hq = G * Hkv (query head h uses key head h // G). lse is ``[Hq, T]`` float32, natural log.

The non-square form (a query block against another key block, as each ring step is): pass
``cu_seqlens_k`` for the keys and, optionally, per-token positions. Query i sees key j iff they
are in the same sequence, ``k_positions[j] >= 0`` (negative: a masked key, e.g. padding) and,
when causal, ``k_positions[j] <= q_positions[i]``. Without positions a sequence's keys are
``0..Lk-1`` and its queries ``Lk-Lq .. Lk-1`` (bottom-right causal alignment, as flash-attn).
A query that sees no key returns ``out = 0``, ``lse = -inf``.

>>> import torch
>>> from primerl.kernels.attention import attention
>>> q, k, v = torch.randn(7, 4, 64), torch.randn(7, 2, 64), torch.randn(7, 2, 64)
>>> cu = torch.tensor([0, 3, 7], dtype=torch.int32)          # two sequences: 3 and 4 tokens
>>> out, lse = attention(q, k, v, cu_seqlens=cu, return_lse=True)   # [7, 4, 64], [4, 7]

Backends (``backend=``):

- ``"torch"``: the float32 reference (``reference.py``), the default on CPU.
- ``"triton"``: flash-attention-2 style forward and a recomputing backward in Triton (``triton.py``);
  every form (positions, any head_dim, float32); on CPU under TRITON_INTERPRET=1. The launchers run
  as ``primerl::`` custom ops (``triton_ops.py``): traceable by torch.compile and FakeTensor.
- ``"cudnn"``: cuDNN's fused attention, what SDPA runs on Hopper, per run of equal-length
  sequences (``cudnn.py``). CUDA, bf16/fp16, head_dim % 8 == 0 up to 128, default positions,
  causal only on square blocks (Lq == Lk per sequence).
- ``"varlen_flash"``: torch's bundled Flash Attention 2 on the packed batch (``varlen_flash.py``).
  CUDA, bf16/fp16, head_dim % 8 == 0 up to 256, default positions (any Lq, Lk: causal is
  bottom-right aligned), native GQA.
- ``"flash_attn"``: the flash-attn package's ``flash_attn_varlen_func``, only when named; no
  positions, lse not differentiable.
- ``"sdpa"``: torch's SDPA kernels per run of equal-length sequences, CPU and CUDA, only when
  named (on CPU several times faster than the reference; see ``sdpa.py``).

``backend=None`` on CUDA picks, per call: ``"cudnn"`` when it covers the case and the batch is at
most ``cudnn.MAX_RUNS`` runs of equal-length sequences; else ``"varlen_flash"`` when it covers the
case; else ``"triton"`` (explicit positions, float32 inputs, head_dims the torch kernels lack).
Ring attention (``primerl.parallel.context``) cuts each step into pseudo-sequences with the
default mask, so its steps take the torch kernels too. A named backend that cannot compute the case raises
``BackendUnavailableError`` with the reason. All of them return lse and take a gradient through
it (cudnn and varlen_flash by widening the head dim in the backward; see ``varlen_flash.py``);
their backward takes an external (ring-merged) out/lse.
"""

from __future__ import annotations

from .mla import mla_attention
from .ops import attention, attention_backward, attention_forward, merge_attn_states, merge_attn_states_
from .spec import AttentionSpec

__all__ = [
    "mla_attention",
    "attention",
    "attention_forward",
    "attention_backward",
    "merge_attn_states",
    "merge_attn_states_",
    "AttentionSpec",
]
