"""primerl.kernels.testing.count_host_reads: what it sees, and that tolist=True leaves Tensor.tolist
as it found it."""

from __future__ import annotations

import pytest
import torch

from primerl.kernels.testing import count_host_reads


def test_dispatched_reads_are_counted_and_tolist_only_on_request():
    x = torch.randn(7, generator=torch.Generator().manual_seed(0))
    with count_host_reads() as plain:
        x.sum().item()
        bool(x[0] > 0)
        (x > 0).nonzero()
        x.tolist()  # no dispatch: invisible without tolist=True
    assert plain.counts == {"_local_scalar_dense": 2, "nonzero": 1}
    with count_host_reads(tolist=True) as all_reads:
        x.tolist()
        x[:3].tolist()
        x.sum().item()
    assert all_reads.counts == {"tolist": 2, "_local_scalar_dense": 1}
    assert all_reads.where[0].startswith("tolist at ") and all_reads.total == 3


def test_tolist_is_restored_even_after_an_error():
    real = torch.Tensor.tolist
    assert "tolist" not in torch.Tensor.__dict__
    with pytest.raises(RuntimeError, match="inside"):
        with count_host_reads(tolist=True):
            with count_host_reads(tolist=True) as inner:
                torch.ones(2).tolist()
            raise RuntimeError("inside")
    assert inner.counts == {"tolist": 1}
    assert "tolist" not in torch.Tensor.__dict__ and torch.Tensor.tolist is real
    assert torch.arange(3).tolist() == [0, 1, 2]
