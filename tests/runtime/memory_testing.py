"""Measuring a trainer rank's peak memory on the CPU, for the memory plan's test.

``measure(cfg, rank, world)`` builds the job's ``Trainer`` (the real model, FSDP2, AdamW, fused
log-probs, ring attention, ...), runs one optimizer step so that the optimizer state and the
gradients exist, then measures the next step with ``bench.cpu_memory.track_peak_cpu_bytes``
(the CPU allocator's running total: exact, allocation by allocation). The peak of a step is what
was live before it (the parameter, gradient and optimizer shards, counted tensor by tensor) plus
the step's own peak above that.

Every rank reads one micro-batch of ``seq_len`` tokens per step (its cp group shares it): 8
sequences of seq_len / 8 tokens with random ids, routing replay and advantages.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

from primerl.rl.packing import Sample, pack
from primerl.runtime.validate import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.cpu_memory import track_peak_cpu_bytes  # noqa: E402

V, DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MOE_DIM, E, K = 512, 128, 2, 4, 2, 32, 128, 4, 2
SEQS = 8
MODEL = ["--model.vocab_size", str(V), "--model.dim", str(DIM), "--model.n_layers", str(LAYERS),
         "--model.n_heads", str(HEADS), "--model.n_kv_heads", str(KV_HEADS), "--model.head_dim", str(HEAD_DIM),
         "--model.moe_dim", str(MOE_DIM), "--model.num_experts", str(E), "--model.top_k", str(K),
         "--model.extra", '{"attn_backend": "sdpa", "num_shared_experts": 1}',
         "--trainer.attention", "kernel", "--trainer.mixed_precision", "bf16", "--trainer.loss.method", "reinforce",
         "--device", "cpu"]


# DeepSeek-V3-style multi-head latent attention in the same model (dense MLA form, Dv < Dqk)
MLA = ["--model.family", "deepseek_v3", "--model.n_kv_heads", str(HEADS), "--model.head_dim", "48",
       "--model.extra", '{"attn_backend": "sdpa", "num_shared_experts": 1, "q_lora_rank": 64, "kv_lora_rank": 64, '
       '"qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "qk_norm": false}']


def job_config(world: int, seq_len: int, layout: list[str]):
    """The test model on ``world`` ranks with ``layout`` (overrides; ``MLA`` among them switches the
    attention to multi-head latent attention)."""
    return load_config(None, [*MODEL, "--num_trainer_ranks", str(world), "--orchestrator.seq_len", str(seq_len),
                              *layout])


def _samples(seq_len: int, num_batches: int, step: int) -> list[Sample]:
    g = torch.Generator().manual_seed(1000 + step)
    n = seq_len // SEQS
    out = []
    for _ in range(SEQS * num_batches):
        mask = torch.ones(n, dtype=torch.bool)
        mask[: n // 4] = False
        out.append(Sample(input_ids=torch.randint(0, V, (n,), generator=g), loss_mask=mask,
                          advantages=0.5 + float(torch.rand(1, generator=g)),
                          inference_logprobs=-2 * torch.rand(n, generator=g), temperature=1.0,
                          replay_ids=torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n * LAYERS)])
                          .view(n, LAYERS, K)))
    return out


def _payload(cfg, step: int, data_rank: int, batches: int) -> dict:
    per_rank = pack(_samples(cfg.orchestrator.seq_len, batches, step), cfg.orchestrator.seq_len, batches)
    return {"micro_batches": per_rank[data_rank], "metrics": {}}


def _bytes(tensors, seen: set) -> int:
    """Storage bytes of ``tensors``, each storage once (FSDP's gradients can be views of one buffer)."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        if t.numel() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def state_bytes(trainer) -> dict[str, int]:
    """Bytes of this rank's parameter, gradient and optimizer-state shards."""
    params, seen = list(trainer.model.parameters()), set()
    state = [v for s in trainer.optimizer.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"]
    grads = [p.grad for p in params if p.grad is not None]
    return {"parameters": _bytes(params, seen), "gradients": _bytes(grads, seen), "optimizer": _bytes(state, seen)}


def measure(cfg) -> dict[str, int]:
    """-> {"parameters", "gradients", "optimizer", "step" (the step's peak above them), "peak"}."""
    from primerl.runtime.trainer import Trainer

    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    trainer = Trainer(cfg, V, rank=dist.get_rank() if world > 1 else 0, world_size=world)
    batches = trainer.dims.dp_replicate * trainer.dims.dp_shard
    trainer.train_step(_payload(cfg, 0, trainer.data_rank, batches))
    payload = _payload(cfg, 1, trainer.data_rank, batches)
    static = state_bytes(trainer)
    gc.collect()  # frees of earlier objects during the measured step would not be subtracted
    step = track_peak_cpu_bytes(lambda: trainer.train_step(payload))
    trainer.close()
    return {**static, "step": step, "peak": sum(static.values()) + step}
