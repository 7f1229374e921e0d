"""The LoRA gold test: the MoE transformer with LoRA adapters (attention + routed experts), trained
for 3 AdamW steps on 4 gloo ranks, gives the same losses, step-0 adapter gradients and updated
adapters as one process, on FSDP2, FSDP2 x EP and EP-only layouts (and ring attention x EP where
it is available). The base stays frozen everywhere: only the adapters have gradients.

The data, loss and tolerances are test_parity.py's (the full-model gold test)."""

from __future__ import annotations

import pytest
import torch

from _parallel_dist import spawn
from primerl.models import apply_lora
from primerl.models.parallelize import parallelize
from primerl.parallel.mesh import ParallelDims
from test_parity import (ADAM_EPS, CONFIGS, GRAD_RTOL, LOSS_RTOL, LR, PARAM_RTOL, STEPS, compare,
                         full_tensors, local_batch, make_batches, make_model, pack, token_loss_sum)

WORLD = 4
LAYOUTS = {"dp_shard4": dict(dp_shard=4), "efsdp2_ep2": dict(dp_shard=4, ep=2), "ep4": dict(dp_shard=4, ep=4),
           "cp2_ep2": dict(dp_shard=2, cp=2, ep=2)}
CFG = CONFIGS["qwen3"]


def lora_model():
    """The parity model with rank-2 adapters on attention and the routed experts, B non-zero (so
    every adapter factor gets a gradient at step 0); the same numbers in every process."""
    model = make_model(CFG)
    torch.manual_seed(99)
    apply_lora(model, 2, 4.0, targets=["attention", "experts"])
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _opt(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1,
                             eps=ADAM_EPS)


def reference_run():
    model = lora_model()
    opt = _opt(model)
    losses, grads0 = [], None
    for seqs in make_batches(CFG):
        tokens, positions, labels, rep, cu = pack(seqs)
        loss = token_loss_sum(model, tokens, positions, cu, labels, None) / (labels != -100).sum()
        loss.backward()
        if grads0 is None:
            grads0 = {k: v.grad.clone() for k, v in model.named_parameters() if v.requires_grad}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads0, {k: v.detach().clone() for k, v in model.named_parameters()}


def run_layout(p: ParallelDims, mesh, ref):
    import torch.distributed as dist

    ref_losses, ref_grads0, ref_params = ref
    model = parallelize(lora_model(), p, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
    opt = _opt(model)
    loss_group = mesh["loss"].get_group()
    losses, errors = [], []
    for step, seqs in enumerate(make_batches(CFG)):
        tokens, positions, labels, rep, cu = local_batch(seqs, mesh, p, CFG.top_k)
        n = (labels != -100).sum()
        dist.all_reduce(n, group=loss_group)
        loss = token_loss_sum(model, tokens, positions, cu, labels, None) / n
        loss.backward()
        if step == 0:
            grads = full_tensors(model, mesh, p, grads=True)
            if set(grads) != set(ref_grads0):
                errors.append(f"parameters with gradients differ: {sorted(set(grads) ^ set(ref_grads0))[:4]}")
            errors += compare("step-0 grad", grads, ref_grads0, GRAD_RTOL)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=loss_group)
        losses.append(total.item())
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        if not abs(a - b) <= LOSS_RTOL * abs(b):
            errors.append(f"step {step} loss {a!r} != reference {b!r}")
    errors += compare(f"param after {STEPS} steps", full_tensors(model, mesh, p, grads=False), ref_params, PARAM_RTOL)
    return errors


def _worker(rank, world_size, log):
    ref = reference_run()
    for name, dims in LAYOUTS.items():
        p = ParallelDims(**dims, world_size=world_size, num_experts=CFG.num_experts)
        log.run(name, run_layout, p, p.build_mesh("cpu"), ref)


@pytest.fixture(scope="module")
def lora_parity(tmp_path_factory):
    return spawn(_worker, WORLD, tmp_path_factory.mktemp("lora_parity"))


# xdist_group: under `-n 2 --dist loadgroup` a module fixture is built once per worker that runs one
# of its tests; the group keeps the tests of the one multi-rank spawn on one worker.
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("lora_parity_results")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_lora_matches_single_process(lora_parity, layout):
    assert layout in lora_parity, f"layout {layout} did not run"
    errs = lora_parity[layout]
    if errs and all(e.split(": ", 1)[1].startswith("SKIP: ") for e in errs):
        pytest.skip(errs[0].split("SKIP: ", 1)[1])
    assert errs == [], "\n".join(errs)


def test_lora_reference_is_not_degenerate():
    """Every adapter factor gets a gradient at step 0 and the base none; the adapters move the loss."""
    losses, grads0, _ = reference_run()
    assert grads0 and all(".lora_" in n for n in grads0)
    assert all(g.abs().max() > 0 for g in grads0.values())
    assert losses[0] != losses[-1]
