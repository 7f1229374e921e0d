"""Fused chunked log-probabilities vs the naive full-logits path (forward + backward).

The naive baseline is what a trainer writes without a fused op: float32 logits [T, V],
log_softmax, gather (with autograd), and the entropy of the same logits under no_grad. Both paths
compute log-probs and entropies and backpropagate ``logprobs.sum()`` into hidden and weight.
Reported: median time (ratio = naive / fused, > 1 means faster) and peak memory above the inputs.
"""

from __future__ import annotations

import torch

from primerl.kernels.logprobs import fused_logprobs

from .harness import Row, peak_memory, time_fn


def _naive(hidden, weight, targets):
    logits = hidden.float() @ weight.float().t()
    logp_all = torch.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(1, targets.unsqueeze(1)).squeeze(1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


def run(args) -> list[Row]:
    dev = args.device
    shapes = [(1024, 16384, 256)] if args.quick else [(8192, 65536, 512)]
    backends = ["torch"] + (["triton"] if dev == "cuda" else [])
    rows = []
    for T, V, D in shapes:
        g = torch.Generator(device="cpu").manual_seed(0)
        hidden = (torch.randn(T, D, generator=g) * 0.5).to(dev).requires_grad_()
        weight = (torch.randn(V, D, generator=g) * 0.05).to(dev).requires_grad_()
        targets = torch.randint(0, V, (T,), generator=g).to(dev)

        def step(fn):
            def go():
                hidden.grad = weight.grad = None
                lp, _ent = fn()
                lp.sum().backward()
            return go

        naive = step(lambda: _naive(hidden, weight, targets))
        fused = {b: step(lambda b=b: fused_logprobs(hidden, weight, targets, backend=b)) for b in backends}
        # the full CPU shape takes minutes per pass: one timed pass after one warm-up pass
        repeats, warmup = (3, 1) if dev != "cpu" or args.quick else (1, 1)
        t_naive = time_fn(naive, device=dev, warmup=warmup, repeats=repeats)
        m_naive = peak_memory(naive, device=dev)
        shape = f"T={T} V={V} D={D}"
        rows.append(Row("logprobs fwd+bwd", shape, "float32", "naive", t_naive,
                        extra={"peak_MiB": round(m_naive / 2**20, 1)}))
        for b, fn in fused.items():
            t = time_fn(fn, device=dev, warmup=warmup, repeats=repeats)
            m = peak_memory(fn, device=dev)
            rows.append(Row("logprobs fwd+bwd", shape, "float32", f"fused/{b}", t, ratio=t_naive / t,
                            baseline="naive",
                            extra={"peak_MiB": round(m / 2**20, 1), "mem_vs_naive": f"{m / m_naive:.3f}",
                                   "time_vs_naive": f"{t / t_naive:.2f}"}))
    return rows
