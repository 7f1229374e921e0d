"""Helpers shared by the FP8 training tests: seeded inputs, leaves, and the grouped-linear check
against float64 (SQNR of the output and of both gradients; empty groups get a zero gradient)."""

from __future__ import annotations

import torch

from primerl.kernels import gemm as G
from primerl.kernels.fp8_training import fp8_grouped_linear
from primerl.kernels.testing import sqnr_db

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, seed, scale=1.0, dtype=torch.bfloat16, device=DEV):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def leaf(t):
    return t.detach().clone().requires_grad_()


def check_grouped_linear_against_float64(counts, tail, min_sqnr_db, k=128, n=256, **kwargs):
    """``fp8_grouped_linear(x, w, offsets, **kwargs)`` on groups of ``counts`` rows (``tail`` NaN
    rows past the last offset, never read) forward and backward, against float64."""
    total = sum(counts)
    offsets = G.counts_to_offsets(torch.tensor(counts, dtype=torch.int32)).to(DEV)
    x = randn(total + tail, k, seed=0)
    x[total:] = float("nan")
    w = randn(len(counts), n, k, seed=1, scale=0.05)
    grad = randn(total + tail, n, seed=2)
    xf, wf = leaf(x), leaf(w)
    y = fp8_grouped_linear(xf, wf, offsets, **kwargs)
    y.backward(grad)
    assert not y.isnan().any() and bool((y[total:] == 0).all())
    assert not xf.grad.isnan().any() and bool((xf.grad[total:] == 0).all()) and not wf.grad.isnan().any()
    xr, wr = leaf(x[:total].double()), leaf(w.double())
    yr = G.grouped_gemm_nt(xr, wr, offsets, backend="torch")
    yr.backward(grad[:total].double())
    full = [g for g, c in enumerate(counts) if c > 0]
    assert sqnr_db(yr.detach(), y[:total].detach()) >= min_sqnr_db, "y"
    assert sqnr_db(xr.grad, xf.grad[:total]) >= min_sqnr_db, "dx"
    assert sqnr_db(wr.grad[full], wf.grad[full]) >= min_sqnr_db, "dw"
    for g, c in enumerate(counts):
        if c == 0:
            assert bool((wf.grad[g] == 0).all()), f"empty group {g} got a weight gradient"
