"""The GEMM Triton ops (primerl/kernels/gemm/triton_ops.py) under torch.compile beyond the per-op
cases of compile_kernel_cases.py: a new packing does not recompile, and one tensor given as both
operands (a Gram matrix) traces. Runs where Triton runs (CPU: TRITON_INTERPRET=1, the default)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

import primerl.kernels as K
from primerl.kernels import fp8 as F8
from primerl.kernels import gemm as G
from primerl.kernels.testing import assert_bitwise_equal

pytestmark = [
    pytest.mark.skipif(not K.backend_status("triton").available, reason="Triton unavailable"),
    pytest.mark.no_poison,  # dynamo would trace into the conftest's torch.empty wrapper
]
TR = "triton"


def _step(x, w, wt, offs):
    """Every GEMM Triton op over rows grouped by offsets (differentiable in x and w)."""
    y = G.grouped_gemm_nt(x, w, offs, backend=TR)
    dw = G.k_grouped_gemm_tn(y, x, offs, backend=TR)
    z = G.m_grouped_fp8_gemm_nt_offsets(F8.quant_per_token_group(x.detach(), 128), F8.quant_per_block(wt), offs,
                                        backend=TR)
    qa = G.quant_per_group_colwise(z, offs, layout="blocks", backend=TR)
    qb = G.quant_per_group_colwise(x.detach(), offs, layout="blocks", backend=TR)
    dw8 = G.k_grouped_fp8_gemm_tn_contiguous(qa, qb, offs, backend=TR)
    return y, dw, z, dw8


def _with_grads(fn, x, w, wt, offs):
    outs = fn(x, w, wt, offs)
    return (*outs, *torch.autograd.grad(outs[0].square().sum() + outs[1].square().sum(), (x, w)))


def test_dynamic_shapes_one_graph_over_packings():
    """Four packings (other row counts and group ends): one graph with dynamic=True, bitwise eager."""
    counter = CompileCounter()
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 24, 128, generator=g).requires_grad_()
    wt = torch.randn(3, 128, 128, generator=g)
    compiled = torch.compile(_step, backend=counter, fullgraph=True, dynamic=True)
    with K.debug_checks(False):
        for rows in (9, 14, 20, 31):
            x = torch.randn(rows, 128, generator=g).requires_grad_()
            cuts = torch.sort(torch.randint(0, rows - 1, (2,), generator=g)).values
            offs = torch.cat([cuts, torch.tensor([rows - 1])]).to(torch.int32)  # one tail row
            got, want = _with_grads(compiled, x, w, wt, offs), _with_grads(_step, x, w, wt, offs)
            for i, (got, want) in enumerate(zip(got, want)):
                assert_bitwise_equal(got, want, f"rows={rows} output {i}")
    assert counter.frame_count == 1


@pytest.mark.parametrize("op", ["gemm_nt", "k_grouped_gemm_tn"])
def test_same_tensor_as_both_operands(op):
    """x @ x.T and x_g.T @ x_g: dynamo refuses an autograd.Function given one tensor twice, so the
    op passes a view as the second operand; gradients from both uses reach x."""
    torch._dynamo.reset()
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    offs = torch.tensor([3, 7], dtype=torch.int32)

    def f(t):
        return G.gemm_nt(t, t, backend=TR) if op == "gemm_nt" else G.k_grouped_gemm_tn(t, t, offs, backend=TR)

    def with_grad(fn):
        out = fn(x)
        return out, torch.autograd.grad(out.square().sum(), x)[0]

    got = with_grad(torch.compile(f, backend="aot_eager", fullgraph=True))
    want = with_grad(f)
    for a, b in zip(got, want):
        assert_bitwise_equal(a, b, op)
    ref_out = x.detach() @ x.detach().t() if op == "gemm_nt" else torch.stack(
        [x.detach()[:3].t() @ x.detach()[:3], x.detach()[3:].t() @ x.detach()[3:]])
    ref_grad = torch.autograd.grad((x @ x.t() if op == "gemm_nt" else torch.stack(
        [x[:3].t() @ x[:3], x[3:].t() @ x[3:]])).square().sum(), x)[0]
    assert torch.allclose(want[0], ref_out, rtol=1e-5, atol=1e-5)
    assert torch.allclose(want[1], ref_grad, rtol=1e-4, atol=1e-4)
