"""Graph breaks (torch._dynamo.explain) and host reads (count_host_reads, debug checks off) per op
of h36r's scope. Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python notes/h36r_measure.py"""
import os
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
import torch._dynamo
import primerl.kernels as K
from primerl.kernels.testing import count_host_reads
from primerl.kernels.logprobs import fused_logprobs
from primerl import rl

torch.manual_seed(0)
T, D, V = 12, 8, 40
h = torch.randn(T, D, requires_grad=True)
w = torch.randn(V, D, requires_grad=True)
tg = torch.randint(0, V, (T,))
cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
lp = torch.randn(T).clamp(max=-0.01).requires_grad_()
ilp = lp.detach() + 0.01 * torch.randn(T)
adv = torch.randn(T)
mask = torch.rand(T) > 0.3
rewards = torch.rand(8)


def logprobs_fwd():
    a, e = fused_logprobs(h, w, tg, chunk_size=5, vocab_chunk_size=16)
    return a.sum() + e.sum()


def logprobs_fwd_bwd():  # forward + torch.autograd.grad (traceable, unlike .backward())
    a, e = fused_logprobs(h, w, tg, chunk_size=5, vocab_chunk_size=16)
    return torch.autograd.grad(a.sum() + e.sum(), (h, w))


def logprobs_temp():
    a, e = fused_logprobs(h, w, tg, temperature=torch.full((T,), 0.7), chunk_size=5, vocab_chunk_size=16)
    return a


def loss_plain():
    return rl.policy_loss(lp, ilp, adv, mask)[0]


def loss_cu():
    return rl.policy_loss(lp, ilp, adv, mask, cu_seqlens=cu, method="dppo_tv", aggregation="seq_mean_token_mean",
                          corrections=("geo_rs",))[0]


def grpo():
    return rl.grpo(rewards, 4).advantages


def rloo():
    return rl.rloo(rewards, 4, std_normalize="batch").advantages


def drgrpo():
    return rl.drgrpo(rewards, 4).advantages


def max_rl():
    return rl.max_rl(rewards, 4).advantages


def length_penalty():
    return rl.linear_length_penalty(rewards, torch.arange(8), 0.1)


def seq_ids():
    return rl.losses.seq_ids_from_cu_seqlens(cu, T)


OPS = {k: v for k, v in globals().items() if callable(v) and k in (
    "logprobs_fwd", "logprobs_fwd_bwd", "logprobs_temp", "loss_plain", "loss_cu", "grpo", "rloo", "drgrpo", "max_rl",
    "length_penalty", "seq_ids")}
try:
    from primerl.rl import next_token_batch
    from primerl.rl.packing import Sample, pack
    s = Sample(input_ids=torch.arange(1, 6), loss_mask=torch.tensor([False, False, True, True, True]), advantages=0.5,
               inference_logprobs=torch.zeros(5), temperature=1.0)
    MB = pack([s, s], seq_len=12, num_ranks=1)[0][0]

    def next_token():
        return next_token_batch(MB)[1]
    OPS["next_token_batch"] = next_token
except ImportError:
    pass

print(f"| op | graph breaks | host reads (debug checks off) |\n|---|---|---|")
for name, fn in OPS.items():
    torch._dynamo.reset()
    try:
        ex = torch._dynamo.explain(fn)()
        breaks = f"{ex.graph_break_count} ({ex.graph_count} graphs)"
        reasons = sorted({str(b.reason).splitlines()[0][:70] for b in ex.break_reasons})
    except Exception as exc:  # noqa: BLE001
        breaks, reasons = f"error {type(exc).__name__}", [str(exc)[:100]]
    with K.debug_checks(False), count_host_reads() as c:
        fn()
    print(f"| {name} | {breaks} | {c.total} {dict(c.counts) or ''} |")
    for r in reasons[:4]:
        print(f"|   | {r} | |")
