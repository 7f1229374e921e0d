"""RL layer: policy-loss throughput per method, and packing quality on long-tailed lengths.

Loss rows: forward + backward of ``policy_loss`` on a packed batch of T tokens (sequences of 512),
reported as seconds per million tokens (``s_per_Mtok``); ratio = reinforce's time / this time.
Packing rows: lengths ~ lognormal clipped to [128, 131072] tokens, packed into seq_len = 131072
bins over R ranks: efficiency (non-padding fraction of all tokens, padding micro-batches included)
and imbalance (largest rank's estimated cost / mean).
"""

from __future__ import annotations

import time

import torch

from primerl.rl.losses import LOSS_METHODS, policy_loss
from primerl.rl.packing import Sample, pack, packing_stats

from .harness import Row, time_fn


def _loss_rows(args) -> list[Row]:
    dev = args.device
    T = 1 << (16 if args.quick else 20)
    g = torch.Generator().manual_seed(0)
    ilp = (-torch.rand(T, generator=g) * 2).to(dev)
    lp = (ilp + 0.05 * torch.randn(T, generator=g).to(dev)).requires_grad_()
    cu = torch.arange(0, T + 1, 512, dtype=torch.int32, device=dev)
    adv = torch.randn(T // 512, generator=g).to(dev).repeat_interleave(512)
    mask = (torch.rand(T, generator=g) < 0.9).to(dev)
    configs = [("reinforce", ())] + [(m, ()) for m in LOSS_METHODS if m != "reinforce"]
    configs += [("ppo_clip", ("icepop",)), ("dppo_tv", ("mis", "veto", "geo_rs"))]
    rows, base = [], None
    for method, corr in configs:
        def step():
            lp.grad = None
            loss, _ = policy_loss(lp, ilp, adv, mask, method=method, corrections=corr, cu_seqlens=cu)
            loss.backward()
        t = time_fn(step, device=dev, warmup=2, repeats=5)
        base = base or t
        name = method + ("+" + "+".join(corr) if corr else "")
        rows.append(Row("policy_loss fwd+bwd", f"T={T}", "float32", name, t, ratio=base / t, baseline="reinforce",
                        extra={"s_per_Mtok": f"{t * 1e6 / T:.4f}"}))
    return rows


def _lognormal_samples(n: int, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=g) * 1.3 + 8.0).round().clamp(128, 131072).long().tolist()
    out = []
    for L in lengths:
        ids = torch.zeros(L, dtype=torch.long)
        out.append(Sample(ids, torch.ones(L, dtype=torch.bool), 1.0, torch.zeros(L)))
    return out


def _packing_rows(args) -> list[Row]:
    rows = []
    n = 256 if args.quick else 2048
    samples = _lognormal_samples(n, seed=0)
    total = sum(len(s) for s in samples)
    for ranks in (1, 8) if args.quick else (1, 8, 32):
        t0 = time.perf_counter()
        per_rank = pack(samples, seq_len=131072, num_ranks=ranks)
        dt = time.perf_counter() - t0
        st = packing_stats(per_rank)
        rows.append(Row("pack", f"N={n} tokens={total} seq_len=131072", "-", f"ranks={ranks}", dt,
                        extra={"efficiency": f"{st['efficiency']:.4f}", "imbalance": f"{st['imbalance']:.4f}",
                               "mb_per_rank": int(st["micro_batches_per_rank"])}))
    return rows


def run(args) -> list[Row]:
    return _loss_rows(args) + _packing_rows(args)
