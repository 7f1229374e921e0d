"""primerl.kernels.moe: routing + replay, layout, permute / combine, SwiGLU kernels, fused experts.

Triton runs under the interpreter here (small shapes, big blocks). Its ``exp`` is numpy's, whose
float32 results differ from torch's in the last bit for ~40% of inputs, while on a GPU the kernel
calls libdevice's expf, which is what torch's CUDA exp calls: the ``torch_exp`` fixture makes the
interpreter's exp torch's so the SwiGLU kernels can be held to bitwise equality on CPU too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from primerl.kernels.moe import (
    expert_counts,
    fused_experts,
    moe_align,
    permute,
    topk_route,
    unpermute_combine,
)
from primerl.kernels.moe import reference as R
from primerl.kernels.testing import assert_bitwise_equal, max_rel_err

from primerl.kernels import triton_interpreter_enabled

INTERPRET = triton_interpreter_enabled()
# The CPU tests run Triton under the interpreter; on a GPU machine the gpu tests cover Triton.
ROW_BACKENDS = ["torch", "triton"] if INTERPRET else ["torch"]
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")

# (T, k, E): T=1, k=1, k=E, primes, E=1
ROUTING_CASES = [(1, 1, 1), (1, 3, 3), (7, 2, 5), (13, 1, 4), (6, 4, 4), (29, 3, 11)]


@pytest.fixture
def torch_exp():
    if not INTERPRET:
        yield
        return
    from triton.runtime import interpreter as interp

    orig = interp.InterpreterBuilder.create_exp

    def create_exp(self, arg):
        return self.unary_op(arg, lambda a: torch.exp(torch.from_numpy(np.ascontiguousarray(a))).numpy())

    interp.InterpreterBuilder.create_exp = create_exp
    yield
    interp.InterpreterBuilder.create_exp = orig


def random_ids(t: int, k: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """[T, k] distinct experts per row."""
    if t == 0:
        return torch.zeros(0, k, dtype=torch.int32)
    return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)


def id_cases():
    gen = torch.Generator().manual_seed(1)
    out = [(f"T{t}k{k}E{e}", random_ids(t, k, e, gen), e) for t, k, e in ROUTING_CASES]
    out.append(("all_to_one", torch.full((9, 1), 2, dtype=torch.int32), 5))  # 4 of 5 experts empty
    out.append(("empty_experts", torch.tensor([[0, 6], [6, 0], [0, 6]], dtype=torch.int32), 8))
    return out


ID_CASES = id_cases()


# ------------------------------------------------------------------------------------------ routing
def naive_route(logits, k, score_func, bias, n_groups, topk_groups, norm, scale):
    """Row by row, in float64, straight from the definition (DeepSeek-V3 group limit)."""
    t, e = logits.shape
    scores = logits.double().softmax(-1) if score_func == "softmax" else logits.double().sigmoid()
    ids, weights = [], []
    for r in range(t):
        choice = scores[r] + (0 if bias is None else bias.double())
        if n_groups > 1:
            g = choice.view(n_groups, -1)
            gs = g.topk(min(2, g.shape[1]), dim=-1).values.sum(-1)
            keep = set(gs.topk(topk_groups).indices.tolist())
            choice = torch.stack([g[i] if i in keep else torch.full_like(g[i], -1e30)
                                  for i in range(n_groups)]).view(-1)
        sel = choice.topk(k).indices
        w = scores[r][sel]
        if norm:
            w = w / w.sum()
        ids.append(sel)
        weights.append(w * scale)
    return torch.stack(ids), torch.stack(weights)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_topk_route_matches_definition(score_func, norm, groups):
    torch.manual_seed(2)
    t, e, k = 11, 16, 3
    logits = torch.randn(t, e)
    bias = torch.randn(e) * 0.1 if score_func == "sigmoid" else None
    ids, w = topk_route(logits, k, score_func=score_func, n_groups=groups[0], topk_groups=groups[1],
                        expert_bias=bias, route_norm=norm, route_scale=2.5)
    ref_ids, ref_w = naive_route(logits, k, score_func, bias, groups[0], groups[1], norm, 2.5)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), ref_ids)
    assert max_rel_err(w, ref_w) < 1e-6


def test_expert_bias_changes_selection_not_weights():
    torch.manual_seed(3)
    logits = torch.randn(20, 8)
    bias = torch.zeros(8)
    bias[5] = 10.0  # force expert 5 into every selection
    ids, w = topk_route(logits, 2, score_func="sigmoid", expert_bias=bias)
    assert bool((ids == 5).any(dim=1).all())
    assert torch.equal(w, logits.sigmoid().gather(1, ids.long()))


def test_group_limit_matches_hf_glm4_router():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    torch.manual_seed(4)
    cfg = Glm4MoeConfig(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                        norm_topk_prob=True, routed_scaling_factor=2.5)
    router = Glm4MoeTopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.2)
    x = torch.randn(23, 16)
    logits, hf_w, hf_ids = router(x)
    ids, w = topk_route(logits, 4, score_func="sigmoid", n_groups=4, topk_groups=2,
                        expert_bias=router.e_score_correction_bias, route_norm=True, route_scale=2.5)
    order_hf, order = hf_ids.sort(dim=1), ids.long().sort(dim=1)
    assert torch.equal(order.values, order_hf.values)
    assert max_rel_err(w.gather(1, order.indices).detach(), hf_w.gather(1, order_hf.indices).detach()) < 1e-6


@pytest.mark.parametrize("score_func,norm", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_replay_live_ids_is_bitwise_noop(score_func, norm):
    torch.manual_seed(5)
    logits = torch.randn(17, 8, requires_grad=True)
    g = torch.randn(17, 3)
    ids, w = topk_route(logits, 3, score_func=score_func, route_norm=norm)
    (grad,) = torch.autograd.grad(w, logits, g)
    ids_r, w_r = topk_route(logits, 3, score_func=score_func, route_norm=norm, replay_ids=ids)
    (grad_r,) = torch.autograd.grad(w_r, logits, g)
    assert_bitwise_equal(ids_r, ids, "ids")
    assert_bitwise_equal(w_r, w, "weights")
    assert_bitwise_equal(grad_r, grad, "d logits")


def test_replay_other_ids_renormalised_softmax_and_router_grad():
    torch.manual_seed(6)
    logits = torch.randn(9, 6, requires_grad=True)
    live, _ = topk_route(logits, 2, route_norm=True)
    replay = (live.long() + 1) % 6  # different experts, still distinct per row
    replay = replay[:, [1, 0]].to(torch.int32)  # and a different column order, which is kept
    ids, w = topk_route(logits, 2, route_norm=True, replay_ids=replay)
    assert torch.equal(ids, replay)
    expected = torch.softmax(logits.detach().gather(1, replay.long()), dim=-1)
    assert max_rel_err(w, expected) < 1e-6
    (grad,) = torch.autograd.grad((w * torch.randn(9, 2)).sum(), logits)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize(
    "replay,match",
    [
        (torch.tensor([[0, 6]] * 4), "must lie in"),
        (torch.tensor([[-1, 2]] * 4), "must lie in"),
        (torch.tensor([[1, 1], [0, 2], [0, 2], [0, 2]]), "repeated expert.*row 0"),
        (torch.tensor([[0, 1, 2]] * 4), "must have shape"),
        (torch.tensor([[0, 1]] * 3), "must have shape"),
        (torch.tensor([[0.0, 1.0]] * 4), "dtype"),
    ],
)
def test_invalid_replay_ids_raise(replay, match):
    with pytest.raises(ValueError, match=match):
        topk_route(torch.randn(4, 6), 2, replay_ids=replay)


def test_invalid_arguments_raise():
    with pytest.raises(ValueError, match="top_k"):
        topk_route(torch.randn(4, 6), 7)
    with pytest.raises(ValueError, match="score_func"):
        topk_route(torch.randn(4, 6), 2, score_func="relu")
    with pytest.raises(ValueError, match="n_groups"):
        topk_route(torch.randn(4, 6), 2, n_groups=4)
    with pytest.raises(ValueError, match="must lie in"):
        permute(torch.randn(2, 4), torch.tensor([[0], [5]]), 4)
    with pytest.raises(ValueError, match="w2 must have shape"):
        fused_experts(torch.randn(2, 4), torch.randn(3, 6, 4), torch.randn(3, 4, 2),
                      torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1))


# ------------------------------------------------------------------------------ counts and layout
@pytest.mark.parametrize("name,ids,e", ID_CASES, ids=[c[0] for c in ID_CASES])
@pytest.mark.parametrize("block", [1, 4, 16])
@pytest.mark.parametrize("backend", ROW_BACKENDS)
def test_align_layout(name, ids, e, block, backend):
    t, k = ids.shape
    n = t * k
    counts = expert_counts(ids, e, backend=backend)
    assert torch.equal(counts.long(), torch.bincount(ids.reshape(-1).long(), minlength=e))
    sorted_slots, block_expert, total = moe_align(ids, e, block, backend=backend)
    ref = moe_align(ids, e, block, backend="torch")
    for got, want, what in zip((sorted_slots, block_expert, total), ref, ("sorted", "block_expert", "total")):
        assert_bitwise_equal(got, want, what)
    # the layout, from its definition
    padded = (counts.long() + block - 1) // block * block
    assert int(total) == int(padded.sum())
    flat = ids.reshape(-1).long()
    row = 0
    for ex in range(e):
        mine = torch.nonzero(flat == ex).reshape(-1).tolist()  # increasing slot order
        assert sorted_slots[row : row + len(mine)].tolist() == mine
        assert (sorted_slots[row + len(mine) : row + int(padded[ex])] == n).all()
        assert (block_expert[row // block : (row + int(padded[ex])) // block] == ex).all()
        row += int(padded[ex])
    assert (sorted_slots[row:] == n).all() and (block_expert[-(-row // block):] == -1).all()


@pytest.mark.parametrize("name,ids,e", ID_CASES, ids=[c[0] for c in ID_CASES])
@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("backend", ROW_BACKENDS)
def test_permute_unpermute(name, ids, e, align, backend):
    torch.manual_seed(7)
    t, k = ids.shape
    d = 24
    x = torch.randn(t, d, requires_grad=True)
    x_perm, row_map, offsets = permute(x, ids, e, align, backend=backend)
    x_ref, row_ref, off_ref = permute(x.detach(), ids, e, align, backend="torch")
    assert_bitwise_equal(x_perm.detach(), x_ref, "x_perm")
    assert_bitwise_equal(row_map, row_ref, "row_map")
    assert_bitwise_equal(offsets, off_ref, "offsets")
    # definition: row row_map[t, j] holds x[t], lies in expert ids[t, j]'s group; the rest is zero
    rows = row_map.reshape(-1).long()
    assert_bitwise_equal(x_perm.detach()[rows], x.detach().repeat_interleave(k, 0), "copies")
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), offsets[:-1]])
    e_of = ids.reshape(-1).long()
    assert bool(((rows >= starts[e_of]) & (rows < offsets[e_of])).all())
    pad = torch.ones(x_perm.shape[0], dtype=torch.bool)
    pad[rows] = False
    assert bool((x_perm.detach()[pad] == 0).all())
    assert x_perm.shape[0] == (t * k if align == 1 else int(offsets[-1]))

    # round trip: weight 1 on one copy -> x exactly; combine = weighted sum in fixed j order
    onehot = torch.zeros(t, k)
    onehot[:, 0] = 1.0
    assert_bitwise_equal(unpermute_combine(x_perm.detach(), row_map, onehot, backend=backend), x.detach(), "round trip")
    w = torch.rand(t, k, requires_grad=True)
    y_perm = torch.randn(x_perm.shape[0], d, requires_grad=True)
    y = unpermute_combine(y_perm, row_map, w, backend=backend)
    y_def = torch.zeros(t, d)
    for j in range(k):
        y_def = y_def + y_perm.detach()[row_map[:, j].long()] * w.detach()[:, j : j + 1]
    assert_bitwise_equal(y.detach(), y_def, "combine")

    # gradients against autograd through plain indexing
    gy, gp = torch.randn(t, d), torch.randn_like(x_perm)
    gx, = torch.autograd.grad(x_perm, x, gp)
    gx_ref = gp[row_map.long()].sum(1)
    assert max_rel_err(gx, gx_ref) < 1e-6
    gyp, gw = torch.autograd.grad(y, (y_perm, w), gy)
    yp2, w2 = y_perm.detach().requires_grad_(), w.detach().requires_grad_()
    y2 = (yp2[row_map.long()] * w2.unsqueeze(-1)).sum(1)
    gyp_ref, gw_ref = torch.autograd.grad(y2, (yp2, w2), gy)
    assert max_rel_err(gyp, gyp_ref) < 1e-6 and max_rel_err(gw, gw_ref) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_is_float32_in_fixed_order(dtype):
    torch.manual_seed(8)
    t, k, d = 5, 4, 8
    y_perm = (torch.randn(t * k, d) * 100).to(dtype)
    row_map = torch.arange(t * k, dtype=torch.int32).view(t, k)
    w = torch.rand(t, k)
    acc = torch.zeros(t, d)
    for j in range(k):
        acc = acc + y_perm[row_map[:, j].long()].float() * w[:, j : j + 1]
    for backend in ROW_BACKENDS:
        assert_bitwise_equal(unpermute_combine(y_perm, row_map, w, backend=backend), acc.to(dtype), backend)


# ------------------------------------------------------------------------------------------ SwiGLU
@needs_interpreter
@pytest.mark.parametrize("shape", [(1, 2), (37, 256), (5, 2 * 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_triton_bitwise(torch_exp, shape, dtype):
    from primerl.kernels.moe import triton as TR

    torch.manual_seed(9)
    gu = (torch.randn(*shape) * 4).to(dtype)
    dh = torch.randn(shape[0], shape[1] // 2).to(dtype)
    assert_bitwise_equal(TR.swiglu(gu), R.swiglu(gu), "swiglu")
    assert_bitwise_equal(TR.swiglu_backward(gu, dh), R.swiglu_backward(gu, dh), "swiglu backward")
    g, u = gu[:, : shape[1] // 2].double(), gu[:, shape[1] // 2 :].double()
    assert max_rel_err(R.swiglu(gu), F.silu(g) * u) < (1e-6 if dtype == torch.float32 else 1e-2)
    gd = g.detach().requires_grad_()
    ud = u.detach().requires_grad_()
    ref = torch.autograd.grad(F.silu(gd) * ud, (gd, ud), dh.double())
    assert max_rel_err(R.swiglu_backward(gu, dh), torch.cat(ref, 1)) < (1e-5 if dtype == torch.float32 else 1e-2)


@needs_interpreter
@pytest.mark.parametrize("m", [1, 19])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("rounding", ["reciprocal", "divide"])
def test_swiglu_quant_triton_bitwise(torch_exp, m, ue8m0, dtype, rounding):
    from primerl.kernels.fp8.reference import quant_per_token_group
    from primerl.kernels.moe import triton as TR

    torch.manual_seed(10)
    gu = (torch.randn(m, 2 * 256) * 3).to(torch.bfloat16)
    gu[0, :128] = 0.0  # an all-zero group: the amax floor
    q, sf = TR.swiglu_quant(gu, 128, dtype, ue8m0, rounding=rounding)
    q_ref, sf_ref = R.swiglu_quant(gu, 128, dtype, ue8m0, rounding=rounding)
    assert_bitwise_equal(sf, sf_ref, "sf")
    assert_bitwise_equal(q, q_ref, "q")
    # the fused op is SwiGLU in float32 followed by the package's per-token-group quantizer
    g, u = gu[:, :256].float(), gu[:, 256:].float()
    q2, sf2 = quant_per_token_group(g * R._sigmoid(g) * u, 128, dtype, ue8m0, rounding=rounding)
    assert_bitwise_equal(q_ref, q2, "q vs quant_per_token_group")
    assert_bitwise_equal(sf_ref, sf2, "sf vs quant_per_token_group")


def test_swiglu_quant_rounding_default_and_check():
    """The default is the DeepGEMM-layout quantizer's ("reciprocal"); the two roundings differ
    on some bytes of a large random input; an unknown rounding is refused by both backends."""
    torch.manual_seed(11)
    gu = torch.randn(512, 2 * 512) * 3
    q_def, _ = R.swiglu_quant(gu, 128, torch.float8_e4m3fn, False)
    q_rec, _ = R.swiglu_quant(gu, 128, torch.float8_e4m3fn, False, rounding="reciprocal")
    q_div, _ = R.swiglu_quant(gu, 128, torch.float8_e4m3fn, False, rounding="divide")
    assert_bitwise_equal(q_def, q_rec, "default rounding")
    assert (q_rec.view(torch.uint8) != q_div.view(torch.uint8)).any(), "the two roundings never differed"
    with pytest.raises(ValueError, match="rounding must be one of"):
        R.swiglu_quant(gu, 128, torch.float8_e4m3fn, False, rounding="nearest")


@needs_interpreter
@pytest.mark.parametrize("ue8m0", [False, True])
def test_swiglu_quant_nan_inf_policy(torch_exp, ue8m0):
    """NaN / inf in SwiGLU's output follow the fp8 quantizers' policy on both backends: a NaN
    propagates to its group's scale (Triton's plain max would drop it), inf saturates."""
    from primerl.kernels.fp8.reference import quant_per_token_group
    from primerl.kernels.moe import triton as TR

    torch.manual_seed(12)
    gu = torch.randn(4, 2 * 256)
    gu[0, 5] = float("nan")  # gate NaN -> h NaN in group 0 of row 0
    gu[1, 256 + 130] = float("inf")  # up inf with a positive gate -> h inf in group 1 of row 1
    gu[1, 130] = 2.0
    gu[2, 256 + 7] = float("-inf")
    gu[2, 7] = 1.0
    ref = R.swiglu_quant(gu, 128, torch.float8_e4m3fn, ue8m0)
    got = TR.swiglu_quant(gu, 128, torch.float8_e4m3fn, ue8m0)
    g, u = gu[:, :256], gu[:, 256:]
    want = quant_per_token_group(g * R._sigmoid(g) * u, 128, torch.float8_e4m3fn, ue8m0)
    for name, (q, sf) in (("triton", got), ("quant_per_token_group", want)):
        assert_bitwise_equal(sf, ref[1], f"sf {name}")
        assert torch.equal(q.float().isnan(), ref[0].float().isnan()), f"NaN positions {name}"
        ok = ~ref[0].float().isnan()
        assert_bitwise_equal(q.float()[ok], ref[0].float()[ok], f"q {name}")
    sf = ref[1]
    if ue8m0:
        assert sf[0, 0] == 2.0 ** 127 and sf[1, 1] == 2.0 ** 127
    else:
        assert sf[0, 0].isnan() and sf[1, 1].isinf() and sf[2, 0].isinf()
    assert ref[0].float()[0, :128].isnan().any()
    assert torch.isfinite(sf[3]).all()


# ----------------------------------------------------------------------------------- fused experts
def naive_experts(x, w13, w2, ids, w):
    i = w2.shape[-1]
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ x[t]
            y[t] = y[t] + w[t, j] * (w2[e] @ (F.silu(gu[:i]) * gu[i:]))
    return y


@pytest.mark.parametrize("name,ids,e", ID_CASES, ids=[c[0] for c in ID_CASES])
@pytest.mark.parametrize("backend", ROW_BACKENDS)
def test_fused_experts_float32_fwd_bwd(torch_exp, name, ids, e, backend):
    torch.manual_seed(11)
    t, k = ids.shape
    d, i = 16, 8
    x = torch.randn(t, d)
    w13, w2 = torch.randn(e, 2 * i, d) / 4, torch.randn(e, d, i) / 3
    w = torch.rand(t, k)
    leaves = [v.clone().requires_grad_() for v in (x, w13, w2, w)]
    y = fused_experts(*leaves[:3], ids, leaves[3], backend=backend)
    ref_leaves = [v.double().requires_grad_() for v in (x, w13, w2, w)]
    y_ref = naive_experts(*ref_leaves[:3], ids, ref_leaves[3])
    assert max_rel_err(y, y_ref) < 1e-5
    gy = torch.randn(t, d)
    grads = torch.autograd.grad(y, leaves, gy)
    ref_grads = torch.autograd.grad(y_ref, ref_leaves, gy.double(), allow_unused=True)
    for name_, g, r in zip(("x", "w13", "w2", "weights"), grads, ref_grads):
        assert max_rel_err(g, r) < 1e-5, name_


def composed_experts(x, w13, w2, ids, w):
    """fused_experts as the op-by-op chain of autograd Functions (what every non-CPU path runs)."""
    from primerl.kernels.moe import _functions as FN

    t, k = ids.shape
    row_of_slot, _, _, _, ends = R.align(ids, w13.shape[0], 1)
    row_map = row_of_slot.view(t, k)
    x_perm = FN.Permute.apply(x, row_map, t * k, R)
    h = FN.SwiGLU.apply(FN.grouped_mm(x_perm, w13, ends), R)
    return FN.Combine.apply(FN.grouped_mm(h, w2, ends), row_map, w, R)


# (T, k, E, D, I): I of 8, 24 and 40 rows of a 16-wide vector register, a full one, uneven groups
BY_EXPERT_CASES = [(1, 1, 1, 8, 8), (9, 1, 5, 16, 24), (13, 3, 11, 24, 40), (40, 4, 4, 32, 16), (300, 8, 16, 64, 32)]


@pytest.mark.parametrize("t,k,e,d,i", BY_EXPERT_CASES)
@pytest.mark.parametrize("needs", ["all", "no_x", "only_weights", "only_w2"])
def test_cpu_expert_by_expert_path_is_bitwise_the_composition(monkeypatch, t, k, e, d, i, needs):
    """The CPU float32 path of fused_experts (primerl.kernels.moe.cpu_experts, one expert at a time,
    its intermediates in reused scratch) gives the bits of the op-by-op chain for y, d w13, d w2 and
    d weights, with empty experts and with only some inputs requiring grad. d x sums a token's k
    row gradients in expert order (accumulated in place, no [T*k, D] buffer) instead of the
    chain's k order: float32 rounding of a reordered sum, held to max_rel_err < 1e-6."""
    from primerl.kernels.moe import cpu_experts

    monkeypatch.setattr(cpu_experts, "MIN_BYTES", 0)  # the path is taken at any size
    torch.manual_seed(16)
    # the last expert gets no token whenever k leaves room for it
    ids = random_ids(t, k, e - 1 if k < e - 1 else e, torch.Generator().manual_seed(t + e))
    x, w = torch.randn(t, d), torch.rand(t, k)
    w13, w2 = torch.randn(e, 2 * i, d) / d**0.5, torch.randn(e, d, i) / i**0.5
    wants = {"all": (1, 1, 1, 1), "no_x": (0, 1, 1, 1), "only_weights": (0, 0, 0, 1), "only_w2": (0, 0, 1, 0)}[needs]
    gy = torch.randn(t, d)
    outs = []
    for fn in (fused_experts, composed_experts):
        leaves = [v.clone().requires_grad_(bool(want)) for v, want in zip((x, w13, w2, w), wants)]
        assert cpu_experts.supported(*leaves[:3], None)
        y = fn(*leaves[:3], ids, leaves[3])
        by_expert = type(y.grad_fn).__name__ == "ExpertsByExpertBackward"
        assert by_expert == (fn is fused_experts)
        grads = torch.autograd.grad(y, [v for v in leaves if v.requires_grad], gy)
        outs.append(dict(zip(["y"] + [n for n, want in zip(("dx", "dw13", "dw2", "dweights"), wants) if want],
                             (y,) + grads)))
    fast, chain = outs
    assert fast.keys() == chain.keys()
    for name in fast:
        if name == "dx":
            assert max_rel_err(fast[name], chain[name].double()) < 1e-6
        else:
            assert_bitwise_equal(fast[name], chain[name], name)


def test_cpu_grouped_rows_path_is_bitwise_the_composition(monkeypatch):
    """experts_on_grouped_rows (the expert-parallel seam) takes the same per-expert path on CPU."""
    from primerl.kernels.moe import _functions as FN
    from primerl.kernels.moe import cpu_experts

    monkeypatch.setattr(cpu_experts, "MIN_BYTES", 0)
    torch.manual_seed(17)
    e, d, i = 5, 24, 40
    ends = torch.tensor([3, 3, 10, 30, 31], dtype=torch.int32)  # expert 1 empty
    x_perm, w13, w2 = torch.randn(31, d), torch.randn(e, 2 * i, d) / 5, torch.randn(e, d, i) / 6
    gy = torch.randn(31, d)
    outs = []
    for fast in (True, False):
        leaves = [v.clone().requires_grad_() for v in (x_perm, w13, w2)]
        if fast:
            y = FN.experts_on_grouped_rows(*leaves, ends, R)
            assert type(y.grad_fn).__name__ == "ExpertsByExpertBackward"
        else:
            y = FN.grouped_mm(FN.SwiGLU.apply(FN.grouped_mm(leaves[0], leaves[1], ends), R), leaves[2], ends)
        outs.append((y,) + torch.autograd.grad(y, leaves, gy))
    for a, b in zip(*outs):
        assert_bitwise_equal(a, b)


def test_cpu_expert_by_expert_path_only_for_large_float32_inputs():
    from primerl.kernels.moe import cpu_experts

    w13 = torch.zeros(4, 512, 256)
    assert cpu_experts.worthwhile(8192, w13) and not cpu_experts.worthwhile(8191, w13)  # 16 MiB of rows
    x, w2 = torch.zeros(3, 256), torch.zeros(4, 256, 256)
    assert cpu_experts.supported(x, w13, w2, None)
    assert not cpu_experts.supported(x, w13, w2, "blockwise")
    assert not cpu_experts.supported(x.double(), w13.double(), w2.double(), None)
    assert not cpu_experts.supported(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), None)


@needs_interpreter
def test_fused_experts_backends_bitwise_bf16(torch_exp):
    torch.manual_seed(12)
    t, k, e, d, i = 10, 3, 6, 32, 16
    ids = random_ids(t, k, e, torch.Generator().manual_seed(3))
    x = torch.randn(t, d, dtype=torch.bfloat16)
    w13 = (torch.randn(e, 2 * i, d) / 5).to(torch.bfloat16)
    w2 = (torch.randn(e, d, i) / 4).to(torch.bfloat16)
    w = torch.rand(t, k)
    outs = {}
    for backend in ROW_BACKENDS:
        leaves = [v.clone().requires_grad_() for v in (x, w13, w2, w)]
        y = fused_experts(*leaves[:3], ids, leaves[3], backend=backend)
        outs[backend] = (y,) + torch.autograd.grad(y, leaves, torch.ones_like(y))
    for a, b, what in zip(outs["triton"], outs["torch"], ("y", "dx", "dw13", "dw2", "dweights")):
        assert_bitwise_equal(a, b, what)
    y_ref = naive_experts(x.double(), w13.double(), w2.double(), ids, w.double())
    assert max_rel_err(outs["torch"][0], y_ref) < 2e-2


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_layout_and_permute_bitwise_on_gpu(backend):
    gen = torch.Generator().manual_seed(13)
    for t, k, e in [(1, 1, 1), (257, 8, 64), (4096, 8, 128), (33, 4, 256)]:
        ids = random_ids(t, k, e, gen).cuda()
        x = torch.randn(t, 72, device="cuda", dtype=torch.bfloat16)
        for block in (1, 16, 128):
            for got, want in zip(moe_align(ids, e, block, backend=backend),
                                 moe_align(ids.cpu(), e, block, backend="torch")):
                assert_bitwise_equal(got.cpu(), want)
            for got, want in zip(permute(x, ids, e, block, backend=backend),
                                 permute(x.cpu(), ids.cpu(), e, block, backend="torch")):
                assert_bitwise_equal(got.detach().cpu(), want.detach())


@pytest.mark.gpu
def test_triton_kernels_bitwise_on_gpu():
    from primerl.kernels.moe import triton as TR

    torch.manual_seed(14)
    gu = (torch.randn(300, 2 * 384, device="cuda") * 4).to(torch.bfloat16)
    dh = torch.randn(300, 384, device="cuda", dtype=torch.bfloat16)
    assert_bitwise_equal(TR.swiglu(gu), R.swiglu(gu), "swiglu")
    assert_bitwise_equal(TR.swiglu_backward(gu, dh), R.swiglu_backward(gu, dh), "swiglu backward")
    for got, want in zip(TR.swiglu_quant(gu, 128, torch.float8_e4m3fn, False),
                         R.swiglu_quant(gu, 128, torch.float8_e4m3fn, False)):
        assert_bitwise_equal(got, want)
    ids = random_ids(500, 8, 64, torch.Generator().manual_seed(4)).cuda()
    row_map = R.align(ids, 64, 1)[0].view(500, 8)
    y_perm = torch.randn(4000, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(500, 8, device="cuda")
    assert_bitwise_equal(TR.combine_rows(y_perm, row_map, w), R.combine_rows(y_perm, row_map, w), "combine")


# ------------------------------------------------------------------------------------------- FP8
# Each e4m3 operand quantization is ~31.7 dB on Gaussian data, one block-scaled GEMM ~28.7 dB; the
# expert MLP chains four quantizations (x, w13, SwiGLU output, w2) and two GEMMs: measured over
# seeds 23.6-24.3 dB for y and dx, 24.8-25.7 dB for dw13 / dw2, and 21.9-24.5 dB for d weights
# (one dot product per slot, only T*k values, so its SQNR varies most). Thresholds sit just below;
# test_fp8_fused_experts_error_is_the_quantization_floor shows the kernels add nothing to it.
FP8_MIN_SQNR_DB = {"y": 23.0, "dx": 23.0, "dw13": 24.0, "dw2": 24.0, "dweights": 20.0}


FP8_CASES = [("torch", "blockwise_fp8_wgrad"), ("triton" if INTERPRET else "torch", "blockwise"), ("torch", "rowwise")]


@pytest.mark.parametrize("backend,recipe", FP8_CASES)
def test_fp8_fused_experts_vs_bf16(torch_exp, backend, recipe):
    from primerl.kernels.testing import sqnr_db

    torch.manual_seed(15)
    t, k, e, d, i = 32, 2, 4, 128, 128
    ids = random_ids(t, k, e, torch.Generator().manual_seed(5))
    ids[:, 0] = torch.where(ids[:, 0] == 3, 0, ids[:, 0])  # expert 3 gets few tokens (maybe none)
    ids[:, 1] = torch.where(ids[:, 1] == 3, (ids[:, 0] + 1) % 3, ids[:, 1])
    x = torch.randn(t, d).to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * i, d) / 11).to(torch.bfloat16)
    w2 = (torch.randn(e, d, i) / 11).to(torch.bfloat16)
    w = torch.rand(t, k)
    gy = torch.randn(t, d).to(torch.bfloat16)
    outs = {}
    for r in (None, recipe):
        leaves = [v.clone().requires_grad_() for v in (x, w13, w2, w)]
        y = fused_experts(*leaves[:3], ids, leaves[3], fp8_recipe=r, backend=backend)
        outs[r] = (y,) + torch.autograd.grad(y, leaves, gy)
    for what, ref, got in zip(("y", "dx", "dw13", "dw2", "dweights"), outs[None], outs[recipe]):
        assert got.dtype == ref.dtype and torch.isfinite(got).all(), what
        assert sqnr_db(ref.detach().float(), got.detach().float()) >= FP8_MIN_SQNR_DB[what], what


@pytest.mark.parametrize("shape", [(2, 256, 128), (3, 128, 384)])
def test_fp8_transposed_block_quant_is_bitwise_the_transposed_quantization(shape):
    """Backward transposes the 1-byte FP8 weights instead of a bf16 copy: the same bits."""
    from primerl.kernels.fp8 import quant_per_block
    from primerl.kernels.moe.fp8 import _transposed_block_quant
    from primerl.kernels.testing import assert_bitwise_equal

    w = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    got, want = _transposed_block_quant(w), quant_per_block(w.transpose(1, 2).contiguous())
    assert_bitwise_equal(got[0], want[0], "q")
    assert_bitwise_equal(got[1], want[1], "sf")


def _fp8_chain_emulated(x, w13, w2, ids, w, gy):
    """The FP8 expert MLP with exact (float64) arithmetic between the quantizations, per routed
    slot: what the kernels compute, minus float32 accumulation-order effects. Returns y, dx."""
    from primerl.kernels.fp8 import dequant, quant_per_block, quant_per_token_group

    f8 = torch.float8_e4m3fn

    def act(a):  # [n, K] -> 1x128-group quantized, dequantized, float64
        return dequant(*quant_per_token_group(a, 128), group_shape=(1, 128), out_dtype=torch.float32).double()

    def weight(b):  # [E, N, K] -> 128x128-block quantized, dequantized, float64
        return dequant(*quant_per_block(b.contiguous()), group_shape=(128, 128), out_dtype=torch.float32).double()

    t, k = ids.shape
    sel = ids.long()
    w13q, w2q = weight(w13), weight(w2)
    w13tq, w2tq = weight(w13.transpose(1, 2)), weight(w2.transpose(1, 2))
    x_slots = act(x).unsqueeze(1).expand(t, k, -1)  # quantization is per row: same for every slot
    gu = torch.einsum("tknd,tkd->tkn", w13q[sel], x_slots).to(torch.bfloat16).view(t * k, -1)
    h = dequant(*R.swiglu_quant(gu, 128, f8, False), group_shape=(1, 128), out_dtype=torch.float32).double()
    y_slot = torch.einsum("tkdi,tki->tkd", w2q[sel], h.view(t, k, -1)).to(torch.bfloat16)
    y = (y_slot.float() * w.unsqueeze(-1)).sum(1).to(torch.bfloat16)
    dy_slot = (gy.float().unsqueeze(1) * w.unsqueeze(-1)).to(torch.bfloat16).view(t * k, -1)
    dh = torch.einsum("tkid,tkd->tki", w2tq[sel], act(dy_slot).view(t, k, -1)).to(torch.bfloat16)
    dgu = R.swiglu_backward(gu, dh.view(t * k, -1))
    dx_slot = torch.einsum("tkdn,tkn->tkd", w13tq[sel], act(dgu).view(t, k, -1)).to(torch.bfloat16)
    return y, dx_slot.float().sum(1).to(torch.bfloat16)


@pytest.mark.parametrize("backend", ["triton"] if INTERPRET else ["torch"])
def test_fp8_fused_experts_error_is_the_quantization_floor(torch_exp, backend):
    """The 25 dB asked of FP8 experts vs bf16 is above what e4m3 allows for this chain: the same
    quantizations with exact arithmetic in between (``_fp8_chain_emulated``) give 23.4-24.3 dB for
    y and dx over four seeds of these inputs (~31.7 dB per e4m3 quantization, four of them and a
    SwiGLU in series). What the kernels can be held to: they add nothing to the quantization error.
    Measured: their output equals the emulation bit for bit or to >100 dB; held to >= 60 dB, and
    their SQNR vs bf16 to within 0.3 dB of the emulation's."""
    from primerl.kernels.testing import sqnr_db

    torch.manual_seed(18)
    t, k, e, d, i = 48, 2, 4, 128, 128
    ids = random_ids(t, k, e, torch.Generator().manual_seed(6))
    x = torch.randn(t, d).to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * i, d) / 11).to(torch.bfloat16)
    w2 = (torch.randn(e, d, i) / 11).to(torch.bfloat16)
    w, gy = torch.rand(t, k), torch.randn(t, d).to(torch.bfloat16)
    got, ref = {}, {}
    for recipe, out in (("blockwise", got), (None, ref)):
        xx = x.clone().requires_grad_()
        y = fused_experts(xx, w13, w2, ids, w, fp8_recipe=recipe, backend=backend)
        out["y"], out["dx"] = y.detach(), torch.autograd.grad(y, xx, gy)[0]
    emulated = dict(zip(("y", "dx"), _fp8_chain_emulated(x, w13, w2, ids, w, gy)))
    for what in ("y", "dx"):
        floor = sqnr_db(ref[what].float(), emulated[what].float())
        assert 22.0 < floor < 25.5, (what, floor)  # the e4m3 floor of this chain: not 25 dB
        assert sqnr_db(emulated[what].float(), got[what].float()) >= 60.0, what
        assert sqnr_db(ref[what].float(), got[what].float()) >= floor - 0.3, what


def test_fp8_fused_experts_validation():
    args = (torch.randn(4, 96), torch.randn(2, 256, 96), torch.randn(2, 96, 128), torch.zeros(4, 1, dtype=torch.int32),
            torch.ones(4, 1))
    with pytest.raises(ValueError, match="multiples of 128"):
        fused_experts(*args, fp8_recipe="blockwise")
    with pytest.raises(ValueError, match="recipe must be one of"):
        fused_experts(*args, fp8_recipe="tensorwise")
