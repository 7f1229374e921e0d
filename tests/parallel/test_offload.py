"""primerl.parallel.offload: activation offloading of checkpointed blocks. On one process, the model
with full checkpointing and offload gives the same loss and gradients as without either (1e-6
relative); the hooks offload exactly the checkpointed blocks' saved inputs (none of the tensors
saved inside a block), and give back equal tensors. The CUDA side-stream path is a gpu test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from primerl.kernels.testing import max_rel_err
from primerl.models import MoETransformer, MoETransformerConfig
from primerl.parallel.fsdp import apply_activation_checkpointing
from primerl.parallel.offload import OffloadActivations

CFG = MoETransformerConfig.tiny(vocab_size=32, dim=16, n_heads=4, n_kv_heads=1, head_dim=8, moe_dim=8, num_experts=4,
                                top_k=2)


def _loss_and_grads(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    lens = [7, 12, 3]
    T = sum(lens)
    tokens = torch.randint(32, (T,), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, 7, 19, 22], dtype=torch.int32)
    logits = model(tokens, pos, cu, return_logits=True)
    loss = F.cross_entropy(logits.float(), torch.roll(tokens, -1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _model():
    torch.manual_seed(0)
    return MoETransformer(CFG)


def test_offloaded_checkpointing_matches_plain(monkeypatch):
    loss0, grads0 = _loss_and_grads(_model())
    packed = []
    real_pack = OffloadActivations._pack

    def counting_pack(self, t):
        out = real_pack(self, t)
        packed.append((tuple(t.shape), type(out).__name__))
        return out

    monkeypatch.setattr(OffloadActivations, "_pack", counting_pack)
    model = apply_activation_checkpointing(_model(), "full", offload=True)
    loss1, grads1 = _loss_and_grads(model)
    assert abs(loss1 - loss0) <= 1e-6 * abs(loss0)
    assert grads1.keys() == grads0.keys() and grads0
    for n in grads0:
        assert max_rel_err(grads1[n], grads0[n]) <= 1e-6, n
    # per block: its tensor inputs (hidden states [T, D], positions [T], cu_seqlens), all offloaded
    n_blocks = CFG.n_layers
    hidden = [s for s, kind in packed if s == (22, CFG.dim)]
    assert len(hidden) == n_blocks, packed
    assert all(kind == "_Offloaded" for _, kind in packed)
    assert len(packed) <= 4 * n_blocks, packed  # nothing saved inside the blocks (the checkpoint keeps those)


def test_hooks_round_trip_exactly():
    x = torch.randn(5, 3, requires_grad=True)
    with OffloadActivations():
        y = (x * x).sum()
    y.backward()
    assert torch.equal(x.grad, 2 * x.detach())


@pytest.mark.gpu
def test_side_stream_offload_on_cuda_matches_plain():
    """On CUDA the saved inputs go to pinned host memory on a side stream; loss and gradients equal
    the plain run's and the pinned copies are really on the host."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    model0 = MoETransformer(CFG).cuda()
    torch.manual_seed(0)
    model1 = apply_activation_checkpointing(MoETransformer(CFG).cuda(), "full", offload=True)
    seen = []
    real_pack = OffloadActivations._pack

    def spy(self, t):
        out = real_pack(self, t)
        if hasattr(out, "host"):
            seen.append((out.host.device.type, out.host.is_pinned()))
        return out

    OffloadActivations._pack = spy
    try:
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(32, (22,), generator=g).cuda()
        pos = torch.cat([torch.arange(n) for n in (7, 12, 3)]).cuda()
        cu = torch.tensor([0, 7, 19, 22], dtype=torch.int32).cuda()
        losses, grads = [], []
        for m in (model0, model1):
            loss = F.cross_entropy(m(tokens, pos, cu, return_logits=True).float(), torch.roll(tokens, -1))
            loss.backward()
            losses.append(loss.item())
            grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    finally:
        OffloadActivations._pack = real_pack
    assert seen and all(dev == "cpu" and pinned for dev, pinned in seen)
    assert abs(losses[1] - losses[0]) <= 1e-5 * abs(losses[0])
    for n in grads[0]:
        assert max_rel_err(grads[1][n], grads[0][n]) <= 1e-5, n
