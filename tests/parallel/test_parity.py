"""The gold standard: a tiny MoE transformer trained for 3 AdamW steps on 4 gloo ranks gives the
same losses and updated parameters as one process, for every layout, live and replayed routing.

Layouts (ParallelDims on 4 ranks; expert parallelism borrows from dp_shard x cp, so the issue's
"dp_shard=2 x ep=2" is dp_shard=4 with ep=2: experts on ep=2 x efsdp=2):
  dp_shard4       FSDP over 4
  efsdp2_ep2      dp_shard=4, ep=2
  dp_shard2_cp2   dp_shard=2, cp=2 (ring attention)
  hsdp            dp_replicate=2, dp_shard=2
  ep4             dp_shard=4, ep=4 (one expert shard per rank, efsdp=1)
  cp2_ep2         dp_shard=2, cp=2, ep=2
  hsdp_ep2_ac     dp_replicate=2, dp_shard=2, ep=2, full activation checkpointing

The model is test-local (embedding, 2 blocks of GQA attention + the project's MoE, head) until
the project's model can take a mesh. The loss is the token-sum cross entropy divided by the
global token count (all-reduced over the ``loss`` view), so FSDP sums gradients.

AdamW's normalised update amplifies summation-order noise in near-zero gradients: within ONE
process, splitting the batch into 4 micro-batches moved expert weights by 2e-5 (relative) at
lr 1e-2 and 2.5e-6 at lr 1e-3, so the test runs at lr 1e-3 to keep the 1e-5 bound meaningful.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _parallel_dist import spawn
from _tiny_moe import EXPERTS, LAYERS, TOP_K, VOCAB, TinyMoELM
from primerl.kernels.attention import attention
from primerl.kernels.testing import max_rel_err
from primerl.parallel.expert import apply_expert_parallel
from primerl.parallel.fsdp import apply_activation_checkpointing, apply_fsdp
from primerl.parallel.mesh import ParallelDims

try:
    from primerl.parallel.context import ContextShardPlan, ring_attention

    RING_REASON = None
except ImportError as e:  # the attention issue's ring attention has not landed
    RING_REASON = f"primerl.parallel.context is not available ({e})"

WORLD = 4
STEPS, NUM_SEQS, LR = 3, 8, 1e-3
LOSS_RTOL, PARAM_RTOL = 1e-5, 1e-5

LAYOUTS = {
    "dp_shard4": dict(dp_shard=4),
    "efsdp2_ep2": dict(dp_shard=4, ep=2),
    "dp_shard2_cp2": dict(dp_shard=2, cp=2),
    "hsdp": dict(dp_replicate=2, dp_shard=2),
    "ep4": dict(dp_shard=4, ep=4),
    "cp2_ep2": dict(dp_shard=2, cp=2, ep=2),
    "hsdp_ep2_ac": dict(dp_replicate=2, dp_shard=2, ep=2),
}
CASES = [f"{name}-{mode}" for name in LAYOUTS for mode in ("live", "replay")]


def make_batches():
    """STEPS global batches of NUM_SEQS sequences: (tokens [n], labels [n], replay ids [n, L, k])."""
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(STEPS):
        seqs = []
        for _ in range(NUM_SEQS):
            n = int(torch.randint(2, 11, (1,), generator=g))
            tokens = torch.randint(VOCAB, (n,), generator=g)
            labels = torch.cat([tokens[1:], torch.tensor([-100])])
            replay = torch.stack([torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(LAYERS)])
                                  for _ in range(n)]).to(torch.int32)
            seqs.append((tokens, labels, replay))
        batches.append(seqs)
    return batches


def pack(seqs):
    tokens, labels, replay = (torch.cat(x) for x in zip(*seqs))
    lens = torch.tensor([len(s[0]) for s in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    return tokens, labels, replay, cu


def local_attention(cu):
    return lambda q, k, v: attention(q, k, v, cu_seqlens=cu, causal=True, backend="torch")


def reference_run(replay: bool):
    """One process, the whole global batch each step: losses and final parameters."""
    model = TinyMoELM()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for seqs in make_batches():
        tokens, labels, rep, cu = pack(seqs)
        logits = model(tokens, local_attention(cu), rep if replay else None)
        n = (labels != -100).sum()
        loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / n
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def local_batch(seqs, mesh, p: ParallelDims):
    """This rank's part: the batch view picks a group of sequences, cp splits them by token."""
    batch_rank = mesh["batch"].get_local_rank()
    per = NUM_SEQS // p.batch
    tokens, labels, rep, cu = pack(seqs[batch_rank * per:(batch_rank + 1) * per])
    if p.cp == 1:
        return tokens, labels, rep, local_attention(cu)
    plan = ContextShardPlan(cu, mesh["cp"].get_group(), layout="zigzag")
    tokens, labels, rep = plan.shard(tokens, dim=0), plan.shard(labels, dim=0), plan.shard(rep, dim=0)
    pad = plan.padding_mask
    labels = labels.masked_fill(pad, -100)
    # padded rows still get routed: give them a valid replay row
    rep = torch.where(pad[:, None, None], torch.arange(TOP_K, dtype=rep.dtype).expand_as(rep), rep)
    return tokens, labels, rep, lambda q, k, v: ring_attention(q, k, v, plan, causal=True)


def run_layout(p: ParallelDims, mesh, replay: bool, ac: bool, ref):
    ref_losses, ref_params = ref
    model = TinyMoELM()
    if p.ep > 1:
        apply_expert_parallel(model, mesh["ep"])
    if ac:
        apply_activation_checkpointing(model, "full")
    apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    loss_group = mesh["loss"].get_group()
    losses = []
    for seqs in make_batches():
        tokens, labels, rep, attn_fn = local_batch(seqs, mesh, p)
        n = (labels != -100).sum()
        dist.all_reduce(n, group=loss_group)
        logits = model(tokens, attn_fn, rep if replay else None)
        loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / n
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=loss_group)
        losses.append(total.item())
    errors = []
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        if not abs(a - b) <= LOSS_RTOL * abs(b):
            errors.append(f"step {step} loss {a!r} != reference {b!r}")
    ep_group = mesh["ep"].get_group()
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
        if p.ep > 1 and ".experts." in name:
            parts = [torch.zeros_like(full) for _ in range(p.ep)]
            dist.all_gather(parts, full.contiguous(), group=ep_group)
            full = torch.cat(parts)
        want = ref_params[name]
        if full.shape != want.shape:
            errors.append(f"{name}: shape {tuple(full.shape)} != {tuple(want.shape)}")
        elif not (err := max_rel_err(full, want)) <= PARAM_RTOL:
            errors.append(f"{name}: max rel err {err:.3g} after {STEPS} steps")
    return errors


def _worker(rank, world_size, log, only=None):
    refs = {replay: reference_run(replay) for replay in (False, True)}
    for name, dims in LAYOUTS.items():
        if only and name not in only:
            continue
        p = ParallelDims(**dims, world_size=world_size, num_experts=EXPERTS)
        if p.cp > 1 and RING_REASON:
            for mode in ("live", "replay"):
                log.skip(f"{name}-{mode}", RING_REASON)
            continue
        mesh = p.build_mesh("cpu")
        for replay in (False, True):
            log.run(f"{name}-{'replay' if replay else 'live'}", run_layout, p, mesh, replay, name.endswith("_ac"),
                    refs[replay])


@pytest.fixture(scope="module")
def parity_results(tmp_path_factory):
    return spawn(_worker, WORLD, tmp_path_factory.mktemp("parity"))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_matches_single_process(parity_results, case):
    assert case in parity_results, f"case {case} did not run"
    errs = parity_results[case]
    if errs and all(e.split(": ", 1)[1].startswith("SKIP: ") for e in errs):
        pytest.skip(errs[0].split("SKIP: ", 1)[1])
    assert errs == [], "\n".join(errs)


def test_reference_runs_learn():
    """The single-process reference is not degenerate: the loss moves and replay changes routing."""
    live, replay = reference_run(False), reference_run(True)
    assert all(torch.isfinite(torch.tensor(live[0] + replay[0])))
    assert live[0] != replay[0]
    assert any(not torch.equal(live[1][k], replay[1][k]) for k in live[1] if ".gate." in k)
