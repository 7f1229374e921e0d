"""The RL job: async level 1 vs 0 on a long-tailed generation-length task, and the
trainer-vs-sampler mismatch KL with FP8 inference experts, with and without router replay.

``python -m bench runtime [--quick] [--device cuda]``

Rows:
- ``rl_step async=0`` / ``async=1`` (CPU only): the median wall time per step of the whole job (trainer and
  orchestrator processes, embedded engine) on reverse-text with lognormal lengths (2..48 symbols,
  so a few samples per batch are much longer than the rest). ``ratio`` of the async row is
  (time per step at level 0) / (time per step at level 1): > 1 means the async job is faster.
- ``decode`` (``--device cuda`` only): the embedded engine alone on the GPU, the example's policy,
  256 requests of 6 prompt tokens x 64 new tokens decoded together (KV cache, sampling on the
  device): generated tokens per second in bf16 (the job's engine dtype under mixed precision),
  against the same in float32 (``ratio`` = bf16 rate / float32 rate).
- ``mismatch_kl fp8 replay=off|on`` (CPU only): k3 KL between the trainer's log-probs (full precision) and
  the sampler's (FP8 experts, re-quantized at load) on the same weights and tokens; ``ratio`` of
  the replay row is KL(off) / KL(on).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from .harness import Row

ROOT = Path(__file__).resolve().parents[1]


def _job_cfg(out: Path, level: int, steps: int, device: str = "cpu"):
    from primerl.runtime.validate import load_config

    return load_config(ROOT / "examples" / "reverse_text.toml", ["--device", device,
        "--output_dir", str(out), "--max_steps", str(steps), "--orchestrator.max_async_level", str(level),
        "--orchestrator.max_off_policy_steps", "2", "--orchestrator.batch_size", "16", "--orchestrator.group_size", "4",
        "--env.args", '{"num_symbols": 8, "min_length": 2, "max_length": 48, "length_dist": "lognormal"}',
        "--checkpoint.interval", "0", "--log.plot", "false", "--log.progress", "false"])


def _step_times(level: int, steps: int, device: str = "cpu") -> tuple[float, dict]:
    from primerl.runtime.launch.machine import run_rl

    with tempfile.TemporaryDirectory() as d:
        rows = run_rl(_job_cfg(Path(d), level, steps, device), quiet=True)
    skip = 2  # process start-up and the first weight load
    times = [r["time/step_s"] for r in rows[skip:]]
    return statistics.median(times), {"steps": len(times), "seq_len_max": max(r["seq_len/max"] for r in rows),
                                      "seq_len_mean": round(statistics.mean(r["seq_len/mean"] for r in rows), 1)}


def _mismatch_kl(replay: bool, n_prompts: int) -> float:
    from primerl.rl.envs import ReverseText
    from primerl.rl.packing import Sample, pack
    from primerl.runtime.validate import load_config
    from primerl.runtime.inference.engine import InferenceEngine, Request, SamplingParams
    from primerl.runtime.policy import build_model
    from primerl.runtime.trainer import shifted_logprobs

    env = ReverseText(num_symbols=8, min_length=4, max_length=12)
    cfg = load_config(ROOT / "examples" / "reverse_text.toml", ["--model.dim", "128", "--model.moe_dim", "128"])
    model = build_model(cfg, env.vocab_size)
    with torch.no_grad():  # a "trained-looking" scale: routing decisions that depend on the input
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(10.0)
    engine = InferenceEngine(build_model(cfg, env.vocab_size), fp8_experts=True, max_batch_size=64)
    engine.load_weights(model.state_dict(), 0)
    reqs = [Request(i, list(env.prompt(i).tokens), SamplingParams(max_new_tokens=env.prompt(i).max_new_tokens, seed=i))
            for i in range(n_prompts)]
    samples = []
    for c in engine.generate(reqs):
        n = len(c.prompt) + len(c.tokens)
        fill = torch.arange(2, dtype=c.routing.dtype).expand(1, *c.routing.shape[1:])
        loss_mask = torch.tensor([False] * len(c.prompt) + [True] * len(c.tokens))
        samples.append(Sample(torch.tensor(c.prompt + c.tokens), loss_mask, 0.0,
                              torch.tensor([0.0] * len(c.prompt) + c.logprobs), 1.0, torch.cat([c.routing, fill])[:n]))
    kl_sum = n_tok = 0.0
    with torch.no_grad():
        for mb in pack(samples, 4096, 1, pad_to_seq_len=False)[0]:
            lp, _ = shifted_logprobs(model, mb, replay=replay)
            d = (lp - mb.inference_logprobs)[mb.loss_mask].double()
            kl_sum += float((torch.expm1(d) - d).sum())
            n_tok += int(mb.loss_mask.sum())
    return kl_sum / n_tok


def decode_rate(dtype: torch.dtype, *, requests: int = 256, prompt_len: int = 6, new_tokens: int = 64,
                device: str = "cuda") -> tuple[float, int]:
    """Generated tokens per second of the embedded engine alone (after a warm-up generation that
    compiles the kernels), and the tokens counted."""
    from primerl.rl.envs import ReverseText
    from primerl.runtime.validate import load_config
    from primerl.runtime.inference.engine import InferenceEngine, Request, SamplingParams
    from primerl.runtime.policy import build_model

    env = ReverseText(num_symbols=8, min_length=4, max_length=4)
    cfg = load_config(ROOT / "examples" / "reverse_text.toml", ["--device", device])
    engine = InferenceEngine(build_model(cfg, env.vocab_size, device=device, dtype=dtype), max_batch_size=requests)
    g = torch.Generator().manual_seed(0)

    def batch(n, m, base):
        return [Request(base + i, torch.randint(0, env.vocab_size, (prompt_len,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=m, seed=base + i)) for i in range(n)]

    engine.generate(batch(requests, 4, 0))  # kernels compiled, cache allocated
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = engine.generate(batch(requests, new_tokens, 10_000))
    if device == "cuda":
        torch.cuda.synchronize()
    n = sum(len(o.tokens) for o in outs)
    return n / (time.perf_counter() - t), n


def run(args) -> list[Row]:
    torch.set_num_threads(1)
    rows = []
    if args.device == "cuda":
        shape = "256 req x (6 + 64 tok), example policy"
        rates = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            try:
                rates[name], n = decode_rate(dtype)
                base = rates.get("fp32") if name != "fp32" else None
                rows.append(Row("decode", shape, name, "engine cuda", n / rates[name],
                                ratio=rates[name] / base if base else None, baseline="fp32" if base else "",
                                extra={"tok/s": f"{rates[name]:.0f}"}, values={"tok_per_s": rates[name]}))
            except Exception as e:  # noqa: BLE001 - report the failure as a row
                rows.append(Row("decode", shape, name, "engine cuda", float("nan"), extra={"error": repr(e)[:300]}))
        return rows  # the job on CUDA is `python -m bench job --device cuda` (this module has ~60 s there)
    steps = 6 if args.quick else 12
    t0, info0 = _step_times(0, steps, args.device)
    t1, info1 = _step_times(1, steps, args.device)
    rows.append(Row("rl_step", "reverse-text lognormal len 2..48, 16x4", "fp32", "async=0", t0, extra=info0))
    rows.append(Row("rl_step", "reverse-text lognormal len 2..48, 16x4", "fp32", "async=1", t1, ratio=t0 / t1,
                    baseline="async=0", extra=info1))
    n = 64 if args.quick else 256
    kl_off, kl_on = _mismatch_kl(False, n), _mismatch_kl(True, n)
    rows.append(Row("mismatch_kl", f"fp8 experts, {n} samples", "fp8/fp32", "replay=off", 0.0,
                    extra={"kl": f"{kl_off:.3e}"}))
    rows.append(Row("mismatch_kl", f"fp8 experts, {n} samples", "fp8/fp32", "replay=on", 0.0,
                    ratio=kl_off / max(kl_on, 1e-30), baseline="replay=off", extra={"kl": f"{kl_on:.3e}"}))
    return rows
