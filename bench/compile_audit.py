"""Graph breaks (torch._dynamo.explain) and host reads (primerl.kernels.testing.count_host_reads) per
attention / sparse-attention op and for one training step of the job's model (examples/reverse_text.toml's
model at a small packing), on CPU. Prints markdown tables for bench/RESULTS.md.

    PYTHONPATH=. python -m bench.compile_audit
"""

from __future__ import annotations

import torch

from primerl.kernels import debug_checks
from primerl.kernels.testing import count_host_reads


def _explain(fn, *args):
    import torch._dynamo

    torch._dynamo.reset()
    try:
        ex = torch._dynamo.explain(fn)(*args)
        return ex.graph_break_count, ex.graph_count
    except Exception as e:  # noqa: BLE001 - an audit reports what fails
        return f"error: {type(e).__name__}", "-"


def _host_reads(fn, *args):
    with debug_checks(False), count_host_reads() as c:
        fn(*args)
    return c.total, dict(c.counts)


def _ops():
    from primerl.kernels.attention import attention, merge_attn_states, mla_attention
    from primerl.kernels.sparse_attention import indexer_topk, sparse_attention

    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    T = 13
    cu = torch.tensor([0, 5, 13], dtype=torch.int32)
    q, k, v = r(T, 4, 16).requires_grad_(), r(T, 2, 16).requires_grad_(), r(T, 2, 16).requires_grad_()
    vm = r(T, 2, 8).requires_grad_()
    pos_q, pos_k = torch.arange(T, dtype=torch.int32), torch.arange(T, dtype=torch.int32)

    def att(q, k, v, cu):
        o, lse = attention(q, k, v, cu_seqlens=cu, return_lse=True)
        (o.sum() + lse.sum()).backward()
        return o

    def att_pos(q, k, v, cu):
        o = attention(q, k, v, cu_seqlens=cu, q_positions=pos_q, k_positions=pos_k)
        o.sum().backward()
        return o

    def att_none(q, k, v):
        o = attention(q, k, v)
        o.sum().backward()
        return o

    def mla(q, k, vm, cu):
        o = mla_attention(q, k, vm, cu_seqlens=cu)
        o.sum().backward()
        return o

    def merge(q, k):
        lse = torch.randn(4, T)
        return merge_attn_states(q, lse, q * 2, lse + 1)

    qi, ki, w = r(T, 4, 16), r(T, 16), r(T, 4)

    def idx(qi, ki, w, cu):
        return indexer_topk(qi, ki, w, cu_seqlens=cu, topk=4)

    qs, kvs = r(T, 4, 24).requires_grad_(), r(T, 1, 24).requires_grad_()
    ind = indexer_topk(qi, ki, w, cu_seqlens=cu, topk=4)

    def sparse(qs, kvs, ind):
        o, lse = sparse_attention(qs, kvs, kvs[..., :16], ind, return_lse=True)
        (o.sum() + lse.sum()).backward()
        return o

    return [
        ("attention (cu_seqlens, lse, fwd+bwd)", att, (q, k, v, cu)),
        ("attention (positions)", att_pos, (q, k, v, cu)),
        ("attention (one sequence)", att_none, (q, k, v)),
        ("mla_attention (Dv != Dqk)", mla, (q, k, vm, cu)),
        ("merge_attn_states", merge, (q.detach(), q.detach())),
        ("indexer_topk", idx, (qi, ki, w, cu)),
        ("sparse_attention (fwd+bwd)", sparse, (qs, kvs, ind)),
    ]


def job_model_step(T_lens=(10,) * 8, seed=0, fused_adamw=False):
    """One step of examples/reverse_text.toml's model: forward, fused_logprobs, policy_loss with
    cu_seqlens, backward, AdamW step. Returns a closure and its inputs."""
    from primerl.kernels.logprobs import fused_logprobs
    from primerl.models import MoETransformer
    from primerl.models.config import MoETransformerConfig
    from primerl.rl import policy_loss

    cfg = MoETransformerConfig(vocab_size=16, dim=128, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16, moe_dim=64,
                               num_experts=4, top_k=2, rope_theta=100.0)
    torch.manual_seed(seed)
    model = MoETransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused_adamw or None)
    T = sum(T_lens)
    cu = torch.tensor([0, *torch.tensor(T_lens).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in T_lens])
    ids = torch.randint(0, 16, (T,))
    old = -torch.rand(T)
    adv = torch.randn(T)
    mask = torch.ones(T, dtype=torch.bool)

    def step(ids, pos, cu, old, adv, mask):
        hidden = model(ids, pos, cu)
        lp, _ = fused_logprobs(hidden, model.lm_head.weight, torch.roll(ids, -1))
        loss = policy_loss(lp, old, adv, mask, cu_seqlens=cu, method="dppo_tv", delta_low=0.2, delta_high=0.2,
                           kl_coef=1e-3)
        loss = loss[0] if isinstance(loss, tuple) else loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, step, (ids, pos, cu, old, adv, mask)


def main():
    print("| op | graph breaks | graphs | host reads (eager, debug off) |")
    print("|---|---|---|---|")
    for name, fn, args in _ops():
        n, counts = _host_reads(fn, *args)
        gb, gc = _explain(fn, *args)
        print(f"| {name} | {gb} | {gc} | {n} {counts} |")
    for fused in (False, True):
        model, step, args = job_model_step(fused_adamw=fused)
        step(*args)  # warm-up (optimizer state)
        with debug_checks(False), count_host_reads() as c:
            step(*args)
        where = {}
        for w in c.where:
            where[w] = where.get(w, 0) + 1
        if not fused:
            gb, gc = _explain(lambda *a: model(*a[:3]), *args)
            print(f"| job model forward (explain) | {gb} | {gc} | |")
        print(f"| job model step (fwd, fused_logprobs, policy_loss(cu_seqlens), bwd, AdamW{' fused' if fused else ''})"
              f" | | | {c.total} {dict(c.counts)} |")
        for w, m in sorted(where.items(), key=lambda x: -x[1]):
            print(f"  {m} x {w}")


if __name__ == "__main__":
    main()
