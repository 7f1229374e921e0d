"""DeepEPDispatcher: the adapter's expansion/weighting/autograd against the reference math with a
one-rank stand-in Buffer (CPU), and the real DeepEP on GPUs when ``deep_ep`` is installed."""

from __future__ import annotations

import pytest
import torch

from primerl.kernels.testing import max_rel_err
from primerl.parallel.deepep import DeepEPDispatcher, deep_ep_available


class OneRankBuffer:
    """Stands in for deep_ep.Buffer on a single rank: DeepEP's normal-mode contract, no kernels."""

    group_size = 1

    def __init__(self, num_experts):
        self.num_experts = num_experts
        self.calls = []

    def get_dispatch_layout(self, topk_idx, num_experts):
        assert topk_idx.dtype == torch.int64
        per_expert = torch.bincount(topk_idx.reshape(-1), minlength=num_experts).int()
        return torch.tensor([topk_idx.shape[0]], dtype=torch.int32), None, per_expert, \
            torch.ones(topk_idx.shape[0], 1, dtype=torch.bool), None

    def dispatch(self, x, handle=None, topk_idx=None, topk_weights=None, **layout):
        self.calls.append("dispatch" if handle is None else "cached_dispatch")
        if handle is not None:
            return x.clone(), None, None, None, None, None
        counts = torch.bincount(topk_idx.reshape(-1), minlength=self.num_experts).tolist()
        return x.clone(), topk_idx.clone(), topk_weights.clone(), counts, ("handle",), None

    def combine(self, x, handle, topk_weights=None):
        self.calls.append("combine")
        return x.clone(), None if topk_weights is None else topk_weights.clone(), None


def test_adapter_matches_reference_with_one_rank_buffer():
    T, D, E, K = 9, 16, 4, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g).requires_grad_()
    scale = torch.randn(E, generator=g)
    buf = OneRankBuffer(E)
    disp = DeepEPDispatcher(None, E, buffer=buf)
    x_recv, counts, h = disp.dispatch(x, ids, w)
    assert counts.tolist() == torch.bincount(ids.reshape(-1).long(), minlength=E).tolist()
    # rows grouped by expert, each expert's rows in token order
    want_rows = torch.cat([x.detach()[(ids == e).any(1)] for e in range(E)])
    assert torch.equal(x_recv.detach(), want_rows)
    expert_of_row = torch.repeat_interleave(torch.arange(E), counts)
    y = disp.combine(x_recv.float() * scale[expert_of_row, None], h, out_dtype=torch.float32)
    ref = sum(w[:, j:j + 1] * x.float() * scale[ids[:, j].long(), None] for j in range(K))
    assert max_rel_err(y.detach(), ref.detach()) < 1e-2  # bf16 on the wire
    cot = torch.randn(T, D, generator=g)
    gx, gw = torch.autograd.grad((y * cot).sum(), (x, w))
    rgx, rgw = torch.autograd.grad((ref * cot).sum(), (x, w))
    assert max_rel_err(gx.float(), rgx.float()) < 2e-2 and max_rel_err(gw, rgw) < 2e-2
    assert buf.calls == ["dispatch", "combine", "cached_dispatch", "combine"]


def test_validation():
    disp = DeepEPDispatcher(None, 4, buffer=OneRankBuffer(4))
    with pytest.raises(ValueError, match="bf16"):
        disp.dispatch(torch.randn(3, 8), torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2))
    with pytest.raises(ValueError, match="need x"):
        disp.dispatch(torch.randn(3, 8).bfloat16(), torch.zeros(2, 2, dtype=torch.int64), torch.rand(3, 2))
    with pytest.raises(ValueError, match="low_latency"):
        DeepEPDispatcher(None, 4, buffer=OneRankBuffer(4), low_latency=True)


@pytest.mark.gpu
def test_real_deep_ep_single_rank_round_trip(tmp_path):
    ok, why = deep_ep_available()
    if not ok:
        pytest.skip(why)
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        T, D, E, K = 64, 256, 8, 2
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
        w = torch.rand(T, K, device="cuda")
        disp = DeepEPDispatcher(None, E)
        x_recv, counts, h = disp.dispatch(x, ids, w)
        y = disp.combine(x_recv, h, out_dtype=torch.float32)
        assert max_rel_err(y, x.float() * w.sum(1, keepdim=True)) < 1e-2
    finally:
        dist.destroy_process_group()
