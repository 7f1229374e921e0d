"""Every public op of primerl.kernels.fp8 / .gemm / .moe / .fp8_training / .lora under torch.compile
(fullgraph, aot_eager and inductor, forward and backward), FakeTensorMode and meta tensors, with
no host read in eager; opcheck of every custom op these modules own.

Cases: tests/kernels/compile_kernel_cases.py (tiny shapes, ragged and empty groups). The eager run
is the reference: aot_eager must give the same bits; inductor generates its own C++ for the
elementwise math (its exp / sigmoid round differently), so its results are compared by DeepGEMM's
calc_diff: 1e-6 where no FP8 quantization follows a recomputed value, 2e-3 on the FP8 training
paths (a value that rounds differently can move one FP8 step; measured at most ~4e-4).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensorMode

import primerl.kernels as K
from primerl.kernels.testing import calc_diff, count_host_reads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_kernel_cases import all_cases, float_outputs, outputs  # noqa: E402

CASES = all_cases()
IDS = [c[0] for c in CASES]

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # a clean torch.compile state per test (tests/conftest.py)


def _forward_backward(fn, inputs):
    """Outputs and the gradients of a fixed weighted sum of the float outputs w.r.t. every input
    that requires grad (detached)."""
    res = outputs(fn(*inputs))
    floats = float_outputs(res)
    grads = []
    if floats:
        loss = sum((o.float() * torch.linspace(0.5, 1.5, o.numel(), device=o.device).view(o.shape)).sum()
                   for o in floats)
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = list(torch.autograd.grad(loss, leaves))
    return [r.detach() for r in res], grads


def _bits(t: torch.Tensor) -> torch.Tensor:
    if not t.dtype.is_floating_point and t.element_size() != 1:
        return t
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


ELEMENT_RTOL = 2.0 ** -3
ELEMENT_ATOL_OF_MAX = 0.02


def _compare(name: str, got: list, want: list, tol: float | None) -> None:
    assert len(got) == len(want), name
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{name}[{i}]: {g.shape}/{g.dtype} vs {w.shape}/{w.dtype}"
        if torch.equal(_bits(g), _bits(w)):
            continue
        assert tol is not None and w.dtype.is_floating_point and w.element_size() > 1, \
            f"{name}[{i}]: not bitwise equal to eager ({w.dtype})"
        diff = calc_diff(g.float(), w.float())
        assert diff < tol, f"{name}[{i}]: calc_diff {diff:.2e} >= {tol:.0e}"
        # calc_diff is one number for the whole tensor: a zeroed block of a few elements passes it.
        # Each element may move by one FP8 step of its own value (2^-3 relative in e4m3) plus a
        # floor of 2% of the tensor's largest magnitude (values that cancel to near zero).
        g64, w64 = g.double(), w.double()
        allowed = ELEMENT_RTOL * w64.abs() + ELEMENT_ATOL_OF_MAX * w64.abs().amax()
        excess = ((g64 - w64).abs() - allowed).amax()
        assert excess <= 0, (f"{name}[{i}]: an element differs from eager by more than {ELEMENT_RTOL} x |eager| "
                             f"+ {ELEMENT_ATOL_OF_MAX} x max|eager| (by {float(excess):.3e} more)")


# The compiled tests run without the conftest's poisoned torch.empty: dynamo would trace into the
# wrapper and look its helper up by module name ("conftest"), which is ambiguous when several
# conftest modules are loaded (the whole suite).
@pytest.mark.no_poison
@pytest.mark.parametrize("name,fn,make,grad", CASES, ids=IDS)
def test_aot_eager_fullgraph_is_bitwise_eager(name, fn, make, grad):
    with K.debug_checks(False):
        want_out, want_grad = _forward_backward(fn, make(1))
        got_out, got_grad = _forward_backward(torch.compile(fn, backend="aot_eager", fullgraph=True), make(1))
    assert bool(want_grad) == grad, f"{name}: differentiable={grad} but got {len(want_grad)} gradients"
    _compare(name, got_out + got_grad, want_out + want_grad, tol=None)


def _family(prefixes: tuple[str, ...], skip: tuple[str, ...] = (), keep: tuple[str, ...] = ()):
    """The cases whose name starts with one of ``prefixes`` (less those containing a ``skip``
    string, unless named in ``keep``) as one function (one graph per direction)."""
    chosen = [c for c in CASES if c[0].startswith(prefixes) and (c[0] in keep or not any(s in c[0] for s in skip))]

    def make(seed):
        return [make_(seed + i) for i, (_, _, make_, _) in enumerate(chosen)]

    def fn(*flat):
        out = []
        for (_, f, _, _), inputs in zip(chosen, flat):
            out.extend(outputs(f(*inputs)))
        return tuple(out)

    return [c[0] for c in chosen], fn, make


INDUCTOR_FAMILIES = {
    # name: (case prefixes, variants left to aot_eager (the same code paths as a variant kept), tol).
    # Every public op is in one family once; inductor compiles C++ per graph (seconds each).
    "fp8": (("fp8.",), ("(ue8m0)",), 1e-6),
    "gemm": (("gemm.",), ("(blocks)", "(psum)", "(bf16)", "(m_indices)"), 1e-6),
    "moe": (("moe.",), ("(fp8", "(bf16)", "(groups", "moe.topk_route", "(align=4"), 1e-6),
    "fp8_training": (("fp8_training.",), ("rowwise", "blockwise_fp8_wgrad"), 2e-3),
    "lora": (("lora.",), ("(bf16)", "(m_indices)", "(fp8"), 1e-6),
}


@pytest.mark.no_poison
@pytest.mark.parametrize("family", list(INDUCTOR_FAMILIES))
def test_inductor_fullgraph_matches_eager(family):
    prefixes, skip, tol = INDUCTOR_FAMILIES[family]
    names, fn, make = _family(prefixes, skip, keep=("moe.topk_route(replay_ids)",))

    def flat_fn(*flat):
        return fn(*_unflatten(flat, shapes))

    with K.debug_checks(False):
        nested = make(7)
        shapes = [len(x) for x in nested]
        want_out, want_grad = _forward_backward(flat_fn, [t for x in nested for t in x])
        nested = make(7)
        compiled = torch.compile(flat_fn, backend="inductor", fullgraph=True)
        got_out, got_grad = _forward_backward(compiled, [t for x in nested for t in x])
    _compare(f"{family} {names}", got_out + got_grad, want_out + want_grad, tol=tol)


def _unflatten(flat, shapes):
    out, i = [], 0
    for n in shapes:
        out.append(flat[i:i + n])
        i += n
    return out


@pytest.mark.no_poison
def test_rowwise_fp8_under_inductor():
    """The rowwise recipe (traced autograd Functions with a per-expert loop: the biggest graphs)."""
    names, fn, make = _family(("fp8_training.fp8_linear(rowwise)", "fp8_training.fp8_grouped_linear(rowwise)"))
    with K.debug_checks(False):
        nested = make(3)
        want = _forward_backward(lambda *f: fn(*_unflatten(f, [len(x) for x in nested])),
                                 [t for x in nested for t in x])
        nested = make(3)
        compiled = torch.compile(lambda *f: fn(*_unflatten(f, [len(x) for x in nested])), backend="inductor",
                                 fullgraph=True)
        got = _forward_backward(compiled, [t for x in nested for t in x])
    _compare(f"rowwise {names}", got[0] + got[1], want[0] + want[1], tol=2e-3)


@pytest.mark.parametrize("name,fn,make,grad", CASES, ids=IDS)
def test_fake_and_meta_tensors_give_eager_shapes(name, fn, make, grad):
    want_out, want_grad = _forward_backward(fn, make(2))
    with FakeTensorMode() as mode:
        fake = []
        for t in make(2):
            f = mode.from_tensor(t)
            fake.append(f.requires_grad_(t.requires_grad) if t.requires_grad else f)
        fake_out, fake_grad = _forward_backward(fn, fake)
    meta = [t.detach().to("meta").requires_grad_(t.requires_grad) for t in make(2)]
    meta_out, meta_grad = _forward_backward(fn, meta)
    for kind, got in (("fake", fake_out + fake_grad), ("meta", meta_out + meta_grad)):
        assert [(tuple(t.shape), t.dtype) for t in got] == [(tuple(t.shape), t.dtype) for t in want_out + want_grad], \
            f"{name} under {kind}"


@pytest.mark.parametrize("name,fn,make,grad", CASES, ids=IDS)
def test_no_host_reads_in_eager(name, fn, make, grad):
    """With debug value checks off (the default outside the tests) no op reads device values on the
    host: a GPU run never waits for its queue to drain. The CPU-only reference loops over host
    offsets run inside custom ops (primerl::grouped_gemm_nt_offsets, ...) on CPU tensors."""
    with K.debug_checks(False), count_host_reads() as reads:
        _forward_backward(fn, make(4))
    assert reads.total == 0, f"{name}: {reads.counts} at {reads.where}"


# ------------------------------------------------------------------------------ value checks stay on


@pytest.mark.no_poison
def test_value_checks_still_fire_compiled():
    from primerl.kernels import gemm as G
    from primerl.kernels import moe as M

    def f(a, b, offs, logits, ids):
        return G.grouped_gemm_nt(a, b, offs), M.topk_route(logits, 2, replay_ids=ids)

    good = (torch.randn(5, 16), torch.randn(2, 8, 16), torch.tensor([2, 5], dtype=torch.int32), torch.randn(5, 4),
            torch.tensor([[0, 1]] * 5, dtype=torch.int32))
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with K.debug_checks(False):
        compiled(*good)
        with pytest.raises(RuntimeError, match="offsets must be non-decreasing"):
            compiled(*good[:2], torch.tensor([4, 2], dtype=torch.int32), *good[3:])
        with pytest.raises(RuntimeError, match="replay_ids must lie in"):
            compiled(*good[:4], torch.tensor([[0, 4]] * 5, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"offsets must be non-decreasing.*\[4, 2\]"):  # debug mode: eager detail
        f(*good[:2], torch.tensor([4, 2], dtype=torch.int32), *good[3:])


# ------------------------------------------------------------------------------ opcheck


def _opcheck_samples():
    # the op modules register their ops on import (the public ops import them lazily): import them
    # here, so that the opcheck tests also run alone
    import primerl.kernels.gemm._opaque_ops  # noqa: F401
    import primerl.kernels.lora.fp8_base  # noqa: F401

    if K.backend_status("triton").available:
        import primerl.kernels.lora.triton_ops  # noqa: F401
        import primerl.kernels.fp8.triton_ops  # noqa: F401
        import primerl.kernels.gemm.triton_ops  # noqa: F401
        import primerl.kernels.moe.triton_ops  # noqa: F401
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)
    a = torch.randn(8, 16, generator=g, requires_grad=True)
    b = torch.randn(3, 12, 16, generator=g, requires_grad=True)
    ka, kb = torch.randn(8, 8, generator=g, requires_grad=True), torch.randn(8, 12, generator=g, requires_grad=True)
    xb = torch.randn(9, 128, generator=g).to(torch.bfloat16).requires_grad_()
    wb = (torch.randn(128, 128, generator=g) * 0.1).to(torch.bfloat16).requires_grad_()
    wg = (torch.randn(2, 128, 128, generator=g) * 0.1).to(torch.bfloat16).requires_grad_()
    goffs = torch.tensor([4, 8], dtype=torch.int32)
    gb = torch.randn(9, 128, generator=g).to(torch.bfloat16)
    from primerl.kernels.fp8 import quant_per_block

    wq = quant_per_block(torch.randn(128, 128, generator=g) * 0.1)
    return [
        ("grouped_gemm_nt_offsets", (a, b, offs, torch.float32)),
        ("grouped_gemm_nt_offsets", (a.detach().bfloat16().requires_grad_(), b.detach().bfloat16().requires_grad_(),
                                     offs, torch.float32)),
        ("grouped_gemm_nt_offsets_bwd", (torch.randn(8, 12, generator=g), a.detach(), b.detach(), offs, True, True)),
        ("k_grouped_gemm_tn", (ka, kb, offs, torch.float32)),
        ("k_grouped_gemm_tn_bwd", (torch.randn(3, 8, 12, generator=g), ka.detach(), kb.detach(), offs, True, False)),
        ("grouped_mm", (a, b.transpose(-2, -1), torch.tensor([3, 3, 8], dtype=torch.int32))),
        ("grouped_mm", (ka.t(), kb, torch.tensor([3, 3, 8], dtype=torch.int32))),
        ("grouped_mm_bwd", (torch.randn(8, 12, generator=g), a.detach(), b.detach().transpose(-2, -1),
                            torch.tensor([3, 3, 8], dtype=torch.int32), True, True)),
        ("fp8_linear_fwd", (xb, wb, "blockwise", None)),
        ("fp8_linear_bwd", (gb, xb.detach(), wb.detach(), "blockwise_fp8_wgrad", None, True, True)),
        ("fp8_grouped_linear_fwd", (xb, wg, goffs, "blockwise", None)),
        ("fp8_grouped_linear_bwd", (gb, xb.detach(), wg.detach(), goffs, "blockwise_fp8_wgrad", None, True, True)),
        ("lora_fp8_base_fwd", (xb, *wq, None)),
        ("lora_fp8_base_bwd", (torch.randn(9, 128, generator=g).bfloat16(), *wq, "torch")),
    ] + _opcheck_triton_samples(g)


def _opcheck_triton_samples(g):
    if not K.backend_status("triton").available:
        return []
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)]).to(torch.int32)
    row_map = torch.randperm(10, generator=g).view(5, 2).to(torch.int32)
    gu = torch.randn(6, 16, generator=g)
    return [
        ("moe_align_triton", (ids, 4, 4)),
        ("moe_expert_counts_triton", (ids, 4)),
        ("moe_scatter_rows_triton", (torch.randn(5, 8, generator=g), row_map, torch.rand(5, 2, generator=g), 12)),
        ("moe_scatter_rows_triton", (torch.randn(5, 8, generator=g), row_map, None, 10)),
        ("moe_combine_rows_triton", (torch.randn(10, 8, generator=g), row_map, torch.rand(5, 2, generator=g))),
        ("moe_swiglu_triton", (gu,)),
        ("moe_swiglu_backward_triton", (gu, torch.randn(6, 8, generator=g))),
        ("moe_swiglu_quant_triton", (torch.randn(6, 256, generator=g), 128, torch.float8_e4m3fn, False, "reciprocal")),
        ("fp8_quant_per_token_group_triton", (torch.randn(3, 256, generator=g), 128, torch.float8_e4m3fn, True,
                                              "reciprocal")),
        ("fp8_quant_per_block_triton", (torch.randn(2, 130, 131, generator=g), 128, 128, torch.float8_e5m2, False,
                                        "divide")),
        ("fp8_quant_rowwise_triton", (torch.randn(3, 64, generator=g), torch.float8_e4m3fn, "divide")),
        ("fp8_quant_tensorwise_triton", (torch.randn(3, 64, generator=g), torch.float8_e4m3fn, "divide")),
    ] + _opcheck_gemm_triton_samples(g)


def _opcheck_gemm_triton_samples(g):
    """primerl/kernels/gemm/triton_ops.py: tiny shapes, ragged and empty groups, strided operands."""
    from primerl.kernels import fp8 as F8
    from primerl.kernels import gemm as G

    f32, e4m3 = torch.float32, torch.float8_e4m3fn
    offs = torch.tensor([3, 3, 9], dtype=torch.int32)  # an empty group, 2 tail rows of 11
    mi = torch.cat([torch.full((60,), 1), torch.full((68,), -1)]).to(torch.int32)
    kmi = torch.tensor([0, 0, -1, 0, 0, 0, 2, 2, 2, -1, -1, 2, 2], dtype=torch.int32)
    a = F8.quant_per_token_group(torch.randn(9, 128, generator=g), 128)
    b1 = F8.quant_per_block(torch.randn(130, 128, generator=g))
    b_rows = F8.quant_per_token_group(torch.randn(130, 128, generator=g), 128)  # recipe (1, 1, 128)
    b3 = F8.quant_per_block(torch.randn(3, 130, 128, generator=g))
    am = F8.quant_per_token_group(torch.randn(3, 4, 128, generator=g), 128)
    koffs = torch.tensor([5, 5, 12], dtype=torch.int32)
    ka = G.quant_per_group_colwise(torch.randn(13, 16, generator=g), koffs)
    kb = G.quant_per_group_colwise(torch.randn(13, 24, generator=g), koffs, layout="blocks")
    kb_rows = G.quant_per_group_colwise(torch.randn(13, 24, generator=g), koffs)
    return [
        ("gemm_nt_triton", (torch.randn(6, 32, generator=g), torch.randn(24, 32, generator=g), f32)),
        ("gemm_nt_triton", (torch.randn(6, 32, generator=g), torch.randn(32, 24, generator=g).t(), torch.bfloat16)),
        ("grouped_gemm_nt_offsets_triton", (torch.randn(11, 32, generator=g), torch.randn(3, 24, 32, generator=g),
                                            offs, f32)),
        ("grouped_gemm_nt_m_indices_triton", (torch.randn(128, 32, generator=g), torch.randn(2, 24, 32, generator=g),
                                              mi, f32)),
        ("k_grouped_gemm_tn_triton", (torch.randn(13, 8, generator=g), torch.randn(13, 12, generator=g), koffs, None,
                                      f32)),
        ("k_grouped_gemm_tn_triton", (torch.randn(13, 8, generator=g), torch.randn(13, 12, generator=g), koffs, kmi,
                                      f32)),
        ("fp8_gemm_nt_triton", (*a, *b1, torch.randn(9, 130, generator=g).bfloat16(), None, 128)),
        ("fp8_gemm_nt_triton", (*a, *b_rows, torch.randn(9, 130, generator=g), torch.randn(9, 130, generator=g), 1)),
        ("m_grouped_fp8_gemm_nt_contiguous_triton", (*a, *b3, G.offsets_to_m_indices(offs[:3] - 2, 9),
                                                     torch.randn(9, 130, generator=g), 128)),
        ("m_grouped_fp8_gemm_nt_offsets_triton", (*a, *b3, offs - 2, torch.bfloat16)),
        ("m_grouped_fp8_gemm_nt_masked_triton", (*am, *b3, torch.tensor([4, 0, 2], dtype=torch.int32), 4,
                                                 torch.randn(3, 4, 130, generator=g), 128)),
        ("k_grouped_fp8_gemm_tn_triton", (*ka, *kb_rows, koffs, torch.randn(3, 16, 24, generator=g), None)),
        ("k_grouped_fp8_gemm_tn_triton", (*G.quant_per_group_colwise(torch.randn(13, 16, generator=g), koffs,
                                                                     layout="blocks"), *kb, koffs,
                                          torch.randn(3, 16, 24, generator=g), torch.randn(3, 16, 24, generator=g))),
        ("quant_per_group_colwise_triton", (torch.randn(13, 16, generator=g), koffs, e4m3, False, "reciprocal",
                                            "rows")),
        ("quant_per_group_colwise_triton", (torch.randn(13, 16, generator=g).bfloat16(), koffs, torch.float8_e5m2, True,
                                            "divide", "blocks")),
    ] + _opcheck_lora_triton_samples(g)


def _opcheck_lora_triton_samples(g):
    """primerl/kernels/lora/triton_ops.py: dense (16/32-bit base, a given FP8 base output), grouped
    by offsets (an empty group, 2 tail rows) and by m_indices (aligned contiguous layout)."""
    def rand(*shape, grad=False):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    offs = torch.tensor([3, 3, 9], dtype=torch.int32)
    mi = torch.cat([torch.full((60,), 1), torch.full((68,), -1)]).to(torch.int32)
    x, w, a, b = rand(6, 32, grad=True), rand(24, 32, grad=True), rand(4, 32, grad=True), rand(24, 4, grad=True)
    ga, gb_ = rand(3, 4, 32, grad=True), rand(3, 24, 4, grad=True)
    return [
        ("lora_linear_triton", (x, w, None, a, b, 0.5)),
        ("lora_linear_triton", (x, None, rand(6, 24, grad=True), a, b, 2.0)),
        ("lora_linear_triton_bwd", (rand(6, 24), x.detach(), w.detach(), a.detach(), b.detach(), rand(6, 4), 0.5,
                                    True, True, True, True)),
        ("lora_linear_triton_bwd", (rand(6, 24), x.detach(), None, a.detach(), b.detach(), rand(6, 4), 0.5,
                                    True, False, False, True)),
        ("grouped_lora_triton", (rand(11, 32, grad=True), ga, gb_, offs, "offsets", 0.5)),
        ("grouped_lora_triton", (rand(128, 32, grad=True), ga, gb_, mi, "m_indices", 2.0)),
        ("grouped_lora_triton_bwd", (rand(11, 24), rand(11, 32), ga.detach(), gb_.detach(), rand(11, 4), offs,
                                     "offsets", 0.5, True, True, True)),
        ("grouped_lora_triton_bwd", (rand(128, 24), rand(128, 32), ga.detach(), gb_.detach(), rand(128, 4), mi,
                                     "m_indices", 0.5, True, False, True)),
    ]


@pytest.mark.parametrize("op,args", _opcheck_samples(), ids=[f"{s[0]}-{i}" for i, s in enumerate(_opcheck_samples())])
def test_opcheck(op, args, monkeypatch):
    # opcheck's schema check compares each input before and after the op with torch.allclose, which
    # has no CPU kernel for fp8 (the FP8 GEMMs' operands): compare those bitwise instead
    allclose = torch.allclose

    def fp8_aware_allclose(a, b, *rest, **kw):
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype == a.dtype:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return allclose(a, b, *rest, **kw)

    monkeypatch.setattr(torch, "allclose", fp8_aware_allclose)
    torch.library.opcheck(getattr(torch.ops.primerl, op).default, args)


# ------------------------------------------------------------------------------ frictions


def test_replay_ids_accept_the_models_uint8_routing():
    from primerl.kernels.moe import topk_route

    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    ids, w = topk_route(logits, 2, route_norm=True)
    for dtype in (torch.uint8, torch.int16, torch.int64):
        ids2, w2 = topk_route(logits, 2, route_norm=True, replay_ids=ids.to(dtype))
        assert torch.equal(ids2, ids) and torch.equal(w2, w), dtype
    with pytest.raises(ValueError, match="must lie in"):
        topk_route(logits, 2, replay_ids=torch.tensor([[0, 5]] * 6, dtype=torch.uint8))


def test_bf16_topk_weights_are_cast_to_float32():
    from primerl.kernels.moe import fused_experts, unpermute_combine

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 16, generator=g)
    w13, w2 = torch.randn(3, 16, 16, generator=g), torch.randn(3, 16, 8, generator=g)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]], dtype=torch.int32)
    wb = torch.rand(5, 2, generator=g).to(torch.bfloat16).requires_grad_()
    y = fused_experts(x, w13, w2, ids, wb)
    assert torch.equal(y, fused_experts(x, w13, w2, ids, wb.detach().float()))
    y.sum().backward()
    assert wb.grad is not None and wb.grad.dtype == torch.bfloat16
    yp = torch.randn(10, 16, generator=g)
    rm = torch.randperm(10, generator=g).view(5, 2).to(torch.int32)
    assert torch.equal(unpermute_combine(yp, rm, wb.detach()), unpermute_combine(yp, rm, wb.detach().float()))


def test_permute_num_rows_pads_the_eager_layout():
    from primerl.kernels.moe import permute

    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 8, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)]).to(torch.int32)
    exact, row_map, ends = permute(x, ids, 4, 4)
    bound, row_map2, ends2 = permute(x, ids, 4, 4, num_rows=7 * 2 + 4 * 3)
    assert torch.equal(row_map, row_map2) and torch.equal(ends, ends2)
    assert torch.equal(bound[: exact.shape[0]], exact) and (bound[exact.shape[0]:] == 0).all()
    with pytest.raises(ValueError, match="num_rows=3 is less than"):
        permute(x, ids, 4, 4, num_rows=3)
    with pytest.raises(ValueError, match="less than the padded total"):
        permute(x, ids, 4, 4, num_rows=14) if int(ends[-1]) > 14 else permute(x, ids, 4, 8, num_rows=14)


def test_the_fp8_tolerance_catches_a_zeroed_block_that_calc_diff_lets_through():
    """The defect the element-wise bound guards: 0.4% of a result zeroed passes calc_diff < 2e-3."""
    torch.manual_seed(0)
    want = torch.randn(64, 256)
    got = want.clone()
    got[:8, :8] = 0  # 64 of 16384 elements
    assert calc_diff(got, want) < 2e-3
    with pytest.raises(AssertionError, match="an element differs from eager"):
        _compare("zeroed block", [got], [want], tol=2e-3)
    noisy = want * (1 + 0.06 * torch.rand_like(want).sub(0.5).sign())  # every element one e4m3 step
    _compare("one fp8 step each", [noisy], [want], tol=2e-2)
