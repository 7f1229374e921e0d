"""A test-local tiny MoE language model (the project's MoE module, GQA attention, packed sequences).

``forward(input_ids [T], attn_fn, replay_ids [T, L, k] | None) -> logits [T, V]``; ``attn_fn(q, k, v)``
is local varlen attention or ring attention, chosen by the caller.
"""

from __future__ import annotations

import torch
from torch import nn

from primerl.models.moe import MoE

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, MOE_DIM, EXPERTS, TOP_K, LAYERS = 32, 16, 2, 1, 8, 8, 8, 2, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-6)
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-6)
        self.ffn = MoE(DIM, MOE_DIM, EXPERTS, TOP_K, score_func="softmax", route_norm=True, backend="torch")

    def forward(self, h, attn_fn, replay_ids=None):
        x = self.attention_norm(h)
        T = x.shape[0]
        q = self.wq(x).view(T, HEADS, HEAD_DIM)
        k = self.wk(x).view(T, KV_HEADS, HEAD_DIM)
        v = self.wv(x).view(T, KV_HEADS, HEAD_DIM)
        h = h + self.wo(attn_fn(q, k, v).reshape(T, HEADS * HEAD_DIM))
        return h + self.ffn(self.ffn_norm(h), replay_ids)


class TinyMoELM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=1e-6)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, attn_fn, replay_ids=None):
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, attn_fn, None if replay_ids is None else replay_ids[:, i])
        return self.lm_head(self.norm(h))
