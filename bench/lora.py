"""python -m bench lora [--quick]: LoRA (issue 43) on the CPU, every ratio against a baseline of
the same run.

1. Trainer step (forward, fused log-probs, backward, AdamW) of full fine-tuning vs LoRA (rank 8,
   attention + routed experts) on the main task's model (reverse_text.toml: d=128, 2 layers,
   4 experts top-2) and a wider one (d=512, 4 layers, 8 experts, moe_dim 512): median time
   (interleaved) and the step's peak allocated bytes above the model (CPU allocation tracker).
2. Bytes per weight update: the full weights (float32) against the adapters alone (a PEFT
   adapter directory's tensors, what ``LoRAChannel`` writes).
3. The embedded engine with adapters (``engine_lora``): generating 256 sequences of 4 tokens from
   6-token prompts with the adapters merged into the weights ("merge") against the low-rank path in
   every forward ("forward"), the plain model as baseline; and the time one update takes to apply.
"""

from __future__ import annotations

import torch

from .harness import Row, peak_memory, time_interleaved

SHAPES = {"main d128": dict(dim=128, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16, moe_dim=64, num_experts=4,
                            top_k=2),
          "wide d512": dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, moe_dim=512, num_experts=8,
                            top_k=2)}
RANK, TARGETS = 8, ("attention", "experts")


def _model(shape, lora: bool):
    from primerl.models import MoETransformer, MoETransformerConfig, apply_lora

    torch.manual_seed(0)
    m = MoETransformer(MoETransformerConfig(vocab_size=64, rope_theta=100.0, **SHAPES[shape]))
    if lora:
        apply_lora(m, RANK, 2.0 * RANK, targets=TARGETS)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
    return m


def _train_step(model, opt, T: int):
    from primerl.kernels.logprobs import fused_logprobs

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (T,), generator=g)
    lens = [10] * (T // 10)
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)

    def step():
        h = model(ids, pos, cu)
        lp, _ = fused_logprobs(h, model.lm_head.weight, torch.roll(ids, -1))
        lp.mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _trainer_rows(quick: bool) -> list[Row]:
    rows = []
    T = 640 if quick else 2560
    for shape in SHAPES:
        steps, peaks = {}, {}
        for lora in (False, True):
            m = _model(shape, lora)
            opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
            fn = _train_step(m, opt, T)
            fn()  # AdamW state exists from here on, as in a running job
            name = "lora" if lora else "full"
            steps[name] = fn
            peaks[name] = peak_memory(fn)
        times = time_interleaved(steps, repeats=3 if quick else 5)
        for name in ("full", "lora"):
            rows.append(Row("trainer step", f"{shape} T={T}", "float32", name, times[name],
                            ratio=times["full"] / times[name], baseline="full",
                            extra={"peak_MB": round(peaks[name] / 2**20, 1),
                                   "peak_vs_full": round(peaks[name] / peaks["full"], 3)}))
    return rows


def _bytes_rows() -> list[Row]:
    from primerl.models.lora_io import adapter_tensors

    rows = []
    for shape in SHAPES:
        m = _model(shape, True)
        full = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if ".lora_" not in n)
        lora = sum(t.numel() * t.element_size() for t in adapter_tensors(m).values())
        rows.append(Row("update bytes", shape, "float32", "lora", 0.0, ratio=full / lora, baseline="full weights",
                        extra={"full_MB": round(full / 2**20, 2), "lora_MB": round(lora / 2**20, 3)}))
    return rows


def _engine_rows(quick: bool) -> list[Row]:
    from primerl.models.lora_io import adapter_tensors
    from primerl.runtime.inference.engine import InferenceEngine, Request, SamplingParams
    from primerl.runtime.inference.engine_lora import EngineAdapters

    rows = []
    n = 64 if quick else 256
    for shape in SHAPES:
        src = _model(shape, True)
        tensors = adapter_tensors(src)
        engines = {"plain": InferenceEngine(_model(shape, False), max_batch_size=n)}
        updates = {}
        for mode in ("merge", "forward"):
            eng = InferenceEngine(_model(shape, False), max_batch_size=n)
            eng.adapters = EngineAdapters(eng.model, RANK, 2.0 * RANK, targets=TARGETS, mode=mode)
            eng.load_weights(tensors, 1)
            engines[mode] = eng
            updates[mode] = (lambda e=eng: e.load_weights(tensors, 1))
        counter = [0]

        def gen(e):
            def run():
                counter[0] += 1
                reqs = [Request(counter[0] * 10_000 + i, [1, 3 + i % 8, 4, 5, 6, 2],
                                SamplingParams(max_new_tokens=4, seed=i)) for i in range(n)]
                e.generate(reqs)
            return run

        times = time_interleaved({k: gen(e) for k, e in engines.items()}, repeats=3 if quick else 5)
        for k in ("plain", "merge", "forward"):
            rows.append(Row("engine generate", f"{shape} {n}x4 tokens", "float32", k, times[k],
                            ratio=times["plain"] / times[k], baseline="plain"))
        up = time_interleaved(updates, repeats=3 if quick else 7)
        for k in ("merge", "forward"):
            rows.append(Row("engine apply update", shape, "float32", k, up[k], ratio=up["forward"] / up[k],
                            baseline="forward"))
    return rows


def run(args) -> list[Row]:
    if args.device != "cpu":
        raise SystemExit("bench lora: a CPU benchmark (--device cpu)")
    return _trainer_rows(args.quick) + _bytes_rows() + _engine_rows(args.quick)
