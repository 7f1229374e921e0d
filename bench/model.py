"""python -m bench model [--quick]: forward+backward tokens/s of the MoE transformer against the
Hugging Face implementation of the same config and weights.

A ~100M-parameter Qwen3-MoE config (--quick: a ~2M one). Both models hold identical float32
weights (ours loaded from the checkpoint Hugging Face saved). The batch is B sequences of equal
length: Hugging Face runs it as a [B, S] batch with SDPA attention and its default experts
implementation; ours runs the same tokens packed ([T] with cu_seqlens). Loss: mean of the
logits' log-softmax at the next token (same for both). Ours runs twice: with the attention op's
default backend (the float32 reference on CPU) and with ``config.attn_backend = "sdpa"`` (torch's
fused kernels). Memory per token: peak bytes allocated during one forward+backward (the harness's
CPU tracker, same measure for both) divided by T.
"""

from __future__ import annotations

import os
import statistics
import tempfile

import torch

from .harness import Row, peak_memory, time_fn

_CONFIGS = {
    # vocab, dim, layers, heads, kv_heads, head_dim, moe_dim, experts, top_k
    "100M": dict(vocab_size=16384, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, moe_intermediate_size=256, intermediate_size=1024,
                 num_experts=24, num_experts_per_tok=4, norm_topk_prob=True),
    "2M": dict(vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, moe_intermediate_size=64, intermediate_size=256,
               num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
}


def _hf_and_ours(kw: dict, device: str):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from primerl.models import MoETransformer

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw, attn_implementation="sdpa"))
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = MoETransformer.from_pretrained(tmp, device=device)
    return hf.to(device).train(), ours.train()


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def run(args) -> list[Row]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = args.device
    name, (B, S) = ("2M", (4, 64)) if args.quick else ("100M", (4, 512))
    kw = _CONFIGS[name]
    hf, ours = _hf_and_ours(kw, device)
    n_params = sum(p.numel() for p in ours.parameters())
    T = B * S
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, kw["vocab_size"], (B, S), generator=g).to(device)
    targets = torch.roll(ids, -1, dims=1)
    flat_ids, flat_targets = ids.reshape(-1), targets.reshape(-1)
    pos = torch.arange(S, device=device).repeat(B)
    cu = torch.arange(0, T + 1, S, dtype=torch.int32, device=device)

    def step_ours():
        ours.zero_grad(set_to_none=True)
        _next_token_loss(ours(flat_ids, pos, cu, return_logits=True), flat_targets).backward()

    def step_ours_sdpa():
        ours.config.attn_backend = "sdpa"
        try:
            step_ours()
        finally:
            ours.config.attn_backend = None

    def step_hf():
        hf.zero_grad(set_to_none=True)
        _next_token_loss(hf(input_ids=ids).logits, targets).backward()

    # Interleaved single runs: on a shared machine the load drifts, and measuring one model after
    # the other would charge the drift to one of them.
    repeats = 5 if args.quick else 3
    step_hf(), step_ours(), step_ours_sdpa()
    times_hf, times_ours, times_sdpa = [], [], []
    for _ in range(repeats):
        times_hf.append(time_fn(step_hf, device=device, warmup=0, repeats=1))
        times_ours.append(time_fn(step_ours, device=device, warmup=0, repeats=1))
        times_sdpa.append(time_fn(step_ours_sdpa, device=device, warmup=0, repeats=1))
    t_hf, t_ours, t_sdpa = (statistics.median(t) for t in (times_hf, times_ours, times_sdpa))
    mem_hf = peak_memory(step_hf, device)
    mem_ours = peak_memory(step_ours, device)
    mem_sdpa = peak_memory(step_ours_sdpa, device)
    shape = f"{name} ({n_params / 1e6:.0f}M params) B={B} S={S} E={kw['num_experts']} k={kw['num_experts_per_tok']}"
    rows = []
    for backend, t, mem, ratio in (("hf", t_hf, mem_hf, None), ("primerl", t_ours, mem_ours, t_hf / t_ours),
                                   ("primerl attn_backend=sdpa", t_sdpa, mem_sdpa, t_hf / t_sdpa)):
        rows.append(Row(op="model fwd+bwd", shape=shape, dtype="float32", backend=backend, median_s=t, ratio=ratio,
                        baseline="hf" if ratio is not None else "",
                        extra={"tok/s": f"{T / t:.0f}", "KB/tok": f"{mem / T / 1024:.1f}"}))
    return rows
