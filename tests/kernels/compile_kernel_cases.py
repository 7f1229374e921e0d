"""One small case per public op of primerl.kernels.gemm / .fp8 / .moe / .fp8_training / .lora, shared by
tests/kernels/test_compile_kernels.py and bench/compile_kernels.py (graph breaks, host reads).

A case is ``(name, fn, make_inputs, differentiable)``: ``make_inputs(seed)`` draws fresh tensors
(float inputs that ``fn`` differentiates have ``requires_grad``), ``fn(*inputs)`` returns a tensor
or a tuple of tensors. Shapes are tiny (FP8 ops need K a multiple of 128).
"""

from __future__ import annotations

import torch

import primerl.kernels as PK
from primerl.kernels import fp8 as F8
from primerl.kernels import fp8_training as FT
from primerl.kernels import gemm as G
from primerl.kernels import lora as L
from primerl.kernels import moe as M


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, dtype=torch.float32, grad=False):
    t = torch.randn(*shape, generator=g).to(dtype)
    return t.requires_grad_(grad)


def _offsets(g, rows: int, groups: int, tail: int = 0) -> torch.Tensor:
    """Ragged cumulative ends over ``rows - tail`` rows (an empty group when groups > 2)."""
    cuts = torch.sort(torch.randint(0, rows - tail + 1, (groups - 1,), generator=g)).values
    if groups > 2:
        cuts[0] = cuts[1]  # an empty group
    return torch.cat([cuts, torch.tensor([rows - tail])]).to(torch.int32)


def _ids(g, t: int, k: int, e: int) -> torch.Tensor:
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)


K = 128  # FP8 contraction dim


# ------------------------------------------------------------------------------ fp8


def _fp8_cases():
    def tok(seed):
        return (_randn(_g(seed), 5, 2 * K),)

    def blk(seed):
        return (_randn(_g(seed), 2, 130, K + 3),)

    def deq(seed):
        q, sf = F8.quant_per_token_group(_randn(_g(seed), 5, 2 * K))
        return q, sf

    return [
        ("fp8.quant_per_token_group", lambda x: F8.quant_per_token_group(x, 128), tok, False),
        ("fp8.quant_per_token_group(ue8m0)", lambda x: F8.quant_per_token_group(x, 64, ue8m0=True), tok, False),
        ("fp8.quant_per_block", lambda w: F8.quant_per_block(w), blk, False),
        ("fp8.quant_rowwise", lambda x: F8.quant_rowwise(x), tok, False),
        ("fp8.quant_tensorwise", lambda x: F8.quant_tensorwise(x), tok, False),
        ("fp8.dequant", lambda q, sf: F8.dequant(q, sf, group_shape=(1, 128), out_dtype=torch.float32), deq, False),
    ] + ([] if not PK.backend_status("triton").available else [
        # the Triton launchers (custom ops primerl::fp8_quant_*_triton)
        ("fp8.quant_per_token_group[triton]", lambda x: F8.quant_per_token_group(x, 128, backend="triton"), tok, False),
        ("fp8.quant_per_block[triton]", lambda w: F8.quant_per_block(w, backend="triton"), blk, False),
        ("fp8.quant_rowwise[triton]", lambda x: F8.quant_rowwise(x, backend="triton"), tok, False),
        ("fp8.quant_tensorwise[triton]", lambda x: F8.quant_tensorwise(x, backend="triton"), tok, False),
    ])


# ------------------------------------------------------------------------------ gemm


def _gemm_cases():
    def dense(seed):
        g = _g(seed)
        return _randn(g, 6, 32, grad=True), _randn(g, 24, 32, grad=True)

    def grouped(seed):
        g = _g(seed)
        return _randn(g, 11, 32, grad=True), _randn(g, 3, 24, 32, grad=True), _offsets(g, 11, 3, tail=2)

    def grouped_bf16(seed):
        g = _g(seed)
        return (_randn(g, 11, 32, dtype=torch.bfloat16, grad=True),
                _randn(g, 3, 24, 32, dtype=torch.bfloat16, grad=True), _offsets(g, 11, 3))

    def grouped_mi(seed):
        g = _g(seed)
        mi = torch.randint(-1, 3, (11,), generator=g).to(torch.int32)
        return _randn(g, 11, 32, grad=True), _randn(g, 3, 24, 32, grad=True), mi

    def kgrouped(seed):
        g = _g(seed)
        return _randn(g, 13, 8, grad=True), _randn(g, 13, 12, grad=True), _offsets(g, 13, 3, tail=1)

    def kgrouped_bf16(seed):
        g = _g(seed)
        return (_randn(g, 13, 8, dtype=torch.bfloat16, grad=True), _randn(g, 13, 12, dtype=torch.bfloat16, grad=True),
                _offsets(g, 13, 3, tail=1))

    def fp8_dense(seed):
        g = _g(seed)
        return _randn(g, 5, K), _randn(g, 130, K)

    def fp8_dense_gemm(x, w):
        return G.fp8_gemm_nt(F8.quant_per_token_group(x, 128), F8.quant_per_block(w))

    def fp8_grouped(seed):
        g = _g(seed)
        return _randn(g, 9, K), _randn(g, 3, 130, K), _offsets(g, 9, 3, tail=1)

    def fp8_contig(x, w, offs):
        mi = G.offsets_to_m_indices(offs, x.shape[0])
        return G.m_grouped_fp8_gemm_nt_contiguous(F8.quant_per_token_group(x, 128), F8.quant_per_block(w), mi)

    def fp8_psum(seed):
        g = _g(seed)
        counts = torch.tensor([3, 0, 5], dtype=torch.int32)
        psum = G.counts_to_psum(counts, 128)
        return _randn(g, 260, K), _randn(g, 3, 130, K), psum

    def fp8_contig_psum(x, w, psum):
        return G.m_grouped_fp8_gemm_nt_contiguous(F8.quant_per_token_group(x, 128), F8.quant_per_block(w), psum,
                                                  use_psum_layout=True)

    def fp8_offs(x, w, offs):
        return G.m_grouped_fp8_gemm_nt_offsets(F8.quant_per_token_group(x, 128), F8.quant_per_block(w), offs)

    def fp8_masked(seed):
        g = _g(seed)
        return _randn(g, 3, 4, K), _randn(g, 3, 130, K), torch.tensor([4, 0, 2], dtype=torch.int32)

    def fp8_masked_gemm(x, w, mm):
        y = G.m_grouped_fp8_gemm_nt_masked(F8.quant_per_token_group(x, 128), F8.quant_per_block(w), mm, 4)
        valid = torch.arange(4, device=y.device)[None, :, None] < mm[:, None, None]
        return torch.where(valid, y, 0)  # rows past masked_m hold whatever the allocator left

    def colwise(seed):
        g = _g(seed)
        return _randn(g, 13, 16), _offsets(g, 13, 3, tail=1)

    def kgrouped_fp8(seed):
        g = _g(seed)
        return _randn(g, 13, 16), _randn(g, 13, 24), _offsets(g, 13, 3, tail=1)

    def kgrouped_fp8_gemm(a, b, offs):
        return G.k_grouped_fp8_gemm_tn_contiguous(G.quant_per_group_colwise(a, offs),
                                                  G.quant_per_group_colwise(b, offs), offs)

    def kgrouped_fp8_blocks(a, b, offs):
        qa = G.quant_per_group_colwise(a, offs, layout="blocks")
        qb = G.quant_per_group_colwise(b, offs, layout="blocks")
        return G.k_grouped_fp8_gemm_tn_contiguous(qa, qb, offs)

    return [
        ("gemm.gemm_nt", lambda a, b: G.gemm_nt(a, b), dense, True),
        ("gemm.grouped_gemm_nt(offsets)", lambda a, b, o: G.grouped_gemm_nt(a, b, o), grouped, True),
        ("gemm.grouped_gemm_nt(offsets,bf16)", lambda a, b, o: G.grouped_gemm_nt(a, b, o), grouped_bf16, True),
        ("gemm.grouped_gemm_nt(m_indices)", lambda a, b, mi: G.grouped_gemm_nt(a, b, mi, layout="m_indices"),
         grouped_mi, True),
        ("gemm.k_grouped_gemm_tn", lambda a, b, o: G.k_grouped_gemm_tn(a, b, o), kgrouped, True),
        ("gemm.k_grouped_gemm_tn(bf16)", lambda a, b, o: G.k_grouped_gemm_tn(a, b, o), kgrouped_bf16, True),
        ("gemm.fp8_gemm_nt", fp8_dense_gemm, fp8_dense, False),
        ("gemm.m_grouped_fp8_gemm_nt_contiguous", fp8_contig, fp8_grouped, False),
        ("gemm.m_grouped_fp8_gemm_nt_contiguous(psum)", fp8_contig_psum, fp8_psum, False),
        ("gemm.m_grouped_fp8_gemm_nt_offsets", fp8_offs, fp8_grouped, False),
        ("gemm.m_grouped_fp8_gemm_nt_masked", fp8_masked_gemm, fp8_masked, False),
        ("gemm.quant_per_group_colwise", lambda x, o: G.quant_per_group_colwise(x, o), colwise, False),
        ("gemm.quant_per_group_colwise(blocks)", lambda x, o: G.quant_per_group_colwise(x, o, layout="blocks"),
         colwise, False),
        ("gemm.k_grouped_fp8_gemm_tn_contiguous", kgrouped_fp8_gemm, kgrouped_fp8, False),
        ("gemm.k_grouped_fp8_gemm_tn_contiguous(blocks)", kgrouped_fp8_blocks, kgrouped_fp8, False),
    ] + _gemm_triton_cases(dense, grouped, grouped_bf16, kgrouped, fp8_dense, fp8_grouped, fp8_masked, colwise,
                           kgrouped_fp8)


def _gemm_triton_cases(dense, grouped, grouped_bf16, kgrouped, fp8_dense, fp8_grouped, fp8_masked, colwise,
                       kgrouped_fp8):
    """The GEMM Triton launchers (custom ops primerl::*_triton of primerl/kernels/gemm/triton_ops.py),
    where Triton runs: on CUDA, or on CPU under TRITON_INTERPRET=1 (the tests' default)."""
    if not PK.backend_status("triton").available:
        return []
    tr = "triton"

    def grouped_aligned(seed):
        # the Triton m_indices layout: 128-row blocks of one group each, ascending, group 1 empty
        g = _g(seed)
        mi = torch.cat([torch.zeros(100), torch.full((28,), -1), torch.full((50,), 2), torch.full((78,), -1)])
        return _randn(g, 256, 32, grad=True), _randn(g, 3, 24, 32, grad=True), mi.to(torch.int32)

    def fp8_accumulate(seed):
        g = _g(seed)
        return _randn(g, 5, K), _randn(g, 130, K), _randn(g, 5, 130)

    def fp8_dense_into(x, w, d):
        # DeepGEMM's in-place convention: D = A @ B.T + C with C = D, written into d
        return G.fp8_gemm_nt(F8.quant_per_token_group(x, 128), F8.quant_per_block(w), d, c=d, backend=tr)

    def fp8_masked_gemm(x, w, mm):
        y = G.m_grouped_fp8_gemm_nt_masked(F8.quant_per_token_group(x, 128), F8.quant_per_block(w), mm, 4,
                                           backend=tr)
        return torch.where(torch.arange(4, device=y.device)[None, :, None] < mm[:, None, None], y, 0)

    def colwise_triton(layout):
        return lambda x, o: G.quant_per_group_colwise(x, o, layout=layout, backend=tr)

    def kgrouped_fp8_gemm(layout):
        def f(a, b, offs):
            qa = G.quant_per_group_colwise(a, offs, layout=layout, backend=tr)
            qb = G.quant_per_group_colwise(b, offs, layout=layout, backend=tr)
            return G.k_grouped_fp8_gemm_tn_contiguous(qa, qb, offs, backend=tr)
        return f

    def q(x):
        return F8.quant_per_token_group(x, 128)

    return [
        ("gemm.gemm_nt[triton]", lambda a, b: G.gemm_nt(a, b, backend=tr), dense, True),
        ("gemm.grouped_gemm_nt(offsets)[triton]", lambda a, b, o: G.grouped_gemm_nt(a, b, o, backend=tr), grouped,
         True),
        ("gemm.grouped_gemm_nt(offsets,bf16)[triton]", lambda a, b, o: G.grouped_gemm_nt(a, b, o, backend=tr),
         grouped_bf16, True),
        ("gemm.grouped_gemm_nt(m_indices)[triton]",
         lambda a, b, mi: G.grouped_gemm_nt(a, b, mi, layout="m_indices", backend=tr), grouped_aligned, True),
        ("gemm.k_grouped_gemm_tn[triton]", lambda a, b, o: G.k_grouped_gemm_tn(a, b, o, backend=tr), kgrouped, True),
        ("gemm.fp8_gemm_nt[triton]", lambda x, w: G.fp8_gemm_nt(q(x), F8.quant_per_block(w), backend=tr), fp8_dense,
         False),
        ("gemm.fp8_gemm_nt(d,c=d)[triton]", fp8_dense_into, fp8_accumulate, False),
        ("gemm.m_grouped_fp8_gemm_nt_contiguous[triton]",
         lambda x, w, o: G.m_grouped_fp8_gemm_nt_contiguous(q(x), F8.quant_per_block(w),
                                                            G.offsets_to_m_indices(o, x.shape[0]), backend=tr),
         fp8_grouped, False),
        ("gemm.m_grouped_fp8_gemm_nt_offsets[triton]",
         lambda x, w, o: G.m_grouped_fp8_gemm_nt_offsets(q(x), F8.quant_per_block(w), o, backend=tr), fp8_grouped,
         False),
        ("gemm.m_grouped_fp8_gemm_nt_masked[triton]", fp8_masked_gemm, fp8_masked, False),
        ("gemm.quant_per_group_colwise[triton]", colwise_triton("rows"), colwise, False),
        ("gemm.quant_per_group_colwise(blocks)[triton]", colwise_triton("blocks"), colwise, False),
        ("gemm.k_grouped_fp8_gemm_tn_contiguous[triton]", kgrouped_fp8_gemm("rows"), kgrouped_fp8, False),
        ("gemm.k_grouped_fp8_gemm_tn_contiguous(blocks)[triton]", kgrouped_fp8_gemm("blocks"), kgrouped_fp8, False),
    ]


# ------------------------------------------------------------------------------ moe

T, D, INTER, E, TOPK = 7, 16, 8, 4, 2


def _moe_cases():
    def logits(seed):
        return (_randn(_g(seed), T, E, grad=True),)

    def replay(seed):
        g = _g(seed)
        return _randn(g, T, E, grad=True), _ids(g, T, TOPK, E)

    def ids(seed):
        return (_ids(_g(seed), T, TOPK, E),)

    def perm(seed):
        g = _g(seed)
        return _randn(g, T, D, grad=True), _ids(g, T, TOPK, E)

    def combine(seed):
        g = _g(seed)
        row_map = torch.randperm(T * TOPK, generator=g).view(T, TOPK).to(torch.int32)
        return _randn(g, T * TOPK, D, grad=True), row_map, _randn(g, T, TOPK, grad=True)

    def experts(seed, dtype=torch.float32):
        g = _g(seed)
        return (_randn(g, T, D, dtype=dtype, grad=True),
                (_randn(g, E, 2 * INTER, D) * 0.3).to(dtype).requires_grad_(),
                (_randn(g, E, D, INTER) * 0.3).to(dtype).requires_grad_(), _ids(g, T, TOPK, E),
                torch.rand(T, TOPK, generator=g).requires_grad_())

    def experts_fp8(seed):
        g = _g(seed)
        return (_randn(g, T, K, dtype=torch.bfloat16, grad=True),
                (_randn(g, E, 2 * K, K) * 0.1).to(torch.bfloat16).requires_grad_(),
                (_randn(g, E, K, K) * 0.1).to(torch.bfloat16).requires_grad_(), _ids(g, T, TOPK, E),
                torch.rand(T, TOPK, generator=g).requires_grad_())

    def fused(recipe=None):
        return lambda x, w13, w2, i, w: M.fused_experts(x, w13, w2, i, w, fp8_recipe=recipe)

    return [
        ("moe.topk_route", lambda lg: M.topk_route(lg, TOPK, route_norm=True), logits, True),
        ("moe.topk_route(groups,sigmoid)", lambda lg: M.topk_route(lg, TOPK, score_func="sigmoid", n_groups=2,
                                                                    topk_groups=1), logits, True),
        ("moe.topk_route(replay_ids)", lambda lg, r: M.topk_route(lg, TOPK, route_norm=True, replay_ids=r), replay,
         True),
        ("moe.expert_counts", lambda i: M.expert_counts(i, E), ids, False),
        ("moe.moe_align", lambda i: M.moe_align(i, E, 4), ids, False),
        ("moe.permute", lambda x, i: M.permute(x, i, E), perm, True),
        ("moe.permute(align=4,num_rows)", lambda x, i: M.permute(x, i, E, 4, num_rows=T * TOPK + E * 3), perm, True),
        ("moe.unpermute_combine", lambda y, rm, w: M.unpermute_combine(y, rm, w), combine, True),
        ("moe.fused_experts", fused(), experts, True),
        ("moe.fused_experts(bf16)", fused(), lambda s: experts(s, torch.bfloat16), True),
        ("moe.fused_experts(fp8 blockwise)", fused("blockwise"), experts_fp8, True),
        ("moe.fused_experts(fp8 blockwise_fp8_wgrad)", fused("blockwise_fp8_wgrad"), experts_fp8, True),
        ("moe.fused_experts(fp8 rowwise)", fused("rowwise"), experts_fp8, True),
    ] + _moe_triton_cases(ids, perm, combine, experts, experts_fp8)


def _moe_triton_cases(ids, perm, combine, experts, experts_fp8):
    """The MoE Triton launchers (custom ops primerl::moe_*_triton), where Triton runs: on CUDA, or
    on CPU under TRITON_INTERPRET=1 (the tests' default)."""
    if not PK.backend_status("triton").available:
        return []
    tr = "triton"
    return [
        ("moe.expert_counts[triton]", lambda i: M.expert_counts(i, E, backend=tr), ids, False),
        ("moe.moe_align[triton]", lambda i: M.moe_align(i, E, 4, backend=tr), ids, False),
        ("moe.permute[triton]", lambda x, i: M.permute(x, i, E, backend=tr), perm, True),
        ("moe.unpermute_combine[triton]", lambda y, rm, w: M.unpermute_combine(y, rm, w, backend=tr), combine, True),
        ("moe.fused_experts[triton]", lambda x, w13, w2, i, w: M.fused_experts(x, w13, w2, i, w, backend=tr), experts,
         True),
        ("moe.fused_experts(fp8 blockwise)[triton]",
         lambda x, w13, w2, i, w: M.fused_experts(x, w13, w2, i, w, fp8_recipe="blockwise", backend=tr), experts_fp8,
         True),
    ]


# ------------------------------------------------------------------------------ fp8_training


def _fp8_training_cases():
    def dense(seed):
        g = _g(seed)
        return (_randn(g, 2, 3, K, dtype=torch.bfloat16, grad=True),
                (_randn(g, K, K) * 0.1).to(torch.bfloat16).requires_grad_())

    def grouped(seed):
        g = _g(seed)
        return (_randn(g, 9, K, dtype=torch.bfloat16, grad=True),
                (_randn(g, 3, K, K) * 0.1).to(torch.bfloat16).requires_grad_(), _offsets(g, 9, 3, tail=1))

    cases = []
    for recipe in FT.RECIPES:
        cases.append((f"fp8_training.fp8_linear({recipe})",
                      lambda x, w, r=recipe: FT.fp8_linear(x, w, recipe=r), dense, True))
        cases.append((f"fp8_training.fp8_grouped_linear({recipe})",
                      lambda x, w, o, r=recipe: FT.fp8_grouped_linear(x, w, o, recipe=r), grouped, True))
    return cases


def _lora_cases():
    """lora_linear (16/32-bit base, block-FP8 base, an Fp8Linear base) and grouped_lora (offsets with
    an empty group and a tail, m_indices in the aligned contiguous layout)."""
    def dense(seed, dtype=torch.float32):
        g = _g(seed)
        return (_randn(g, 2, 3, 32, dtype=dtype, grad=True), _randn(g, 24, 32, dtype=dtype, grad=True),
                _randn(g, 4, 32, dtype=dtype, grad=True), _randn(g, 24, 4, dtype=dtype, grad=True))

    def dense_fp8(seed):
        g = _g(seed)
        return (_randn(g, 5, K, dtype=torch.bfloat16, grad=True), *F8.quant_per_block(_randn(g, K, K) * 0.1),
                _randn(g, 8, K, dtype=torch.bfloat16, grad=True), _randn(g, K, 8, dtype=torch.bfloat16, grad=True))

    def dense_recipe(seed):
        g = _g(seed)
        return (_randn(g, 5, K, dtype=torch.bfloat16, grad=True),
                (_randn(g, K, K) * 0.1).to(torch.bfloat16).requires_grad_(),
                _randn(g, 8, K, dtype=torch.bfloat16, grad=True), _randn(g, K, 8, dtype=torch.bfloat16, grad=True))

    def grouped(seed):
        g = _g(seed)
        return (_randn(g, 11, 32, grad=True), _randn(g, 3, 4, 32, grad=True), _randn(g, 3, 24, 4, grad=True),
                _offsets(g, 11, 3, tail=2))

    def grouped_m_indices(seed):
        g = _g(seed)
        mi = torch.cat([torch.full((60,), 1), torch.full((68,), -1), torch.full((30,), 2), torch.full((98,), -1)])
        return (_randn(g, 256, 32, grad=True), _randn(g, 3, 4, 32, grad=True), _randn(g, 3, 24, 4, grad=True),
                mi.to(torch.int32))

    def cases(be, tag):
        return [
            (f"lora.lora_linear{tag}", lambda x, w, a, b: L.lora_linear(x, w, a, b, 0.5, backend=be), dense, True),
            (f"lora.lora_linear(bf16){tag}", lambda x, w, a, b: L.lora_linear(x, w, a, b, 0.5, backend=be),
             lambda s: dense(s, torch.bfloat16), True),
            (f"lora.lora_linear(fp8 weight){tag}",
             lambda x, wq, wsf, a, b: L.lora_linear(x, (wq, wsf), a, b, 2.0, backend=be), dense_fp8, True),
            (f"lora.lora_linear(fp8_recipe){tag}",
             lambda x, w, a, b: L.lora_linear(x, w, a, b, 2.0, fp8_recipe="blockwise", backend=be), dense_recipe, True),
            (f"lora.grouped_lora(offsets){tag}",
             lambda x, a, b, o: L.grouped_lora(x, a, b, 0.5, offsets=o, backend=be), grouped, True),
            (f"lora.grouped_lora(m_indices){tag}",
             lambda x, a, b, mi: L.grouped_lora(x, a, b, 0.5, m_indices=mi, backend=be), grouped_m_indices, True),
        ]

    return cases("torch", "") + (cases("triton", "[triton]") if PK.backend_status("triton").available else [])


def all_cases():
    return _fp8_cases() + _gemm_cases() + _moe_cases() + _fp8_training_cases() + _lora_cases()


def outputs(result) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def float_outputs(result) -> list[torch.Tensor]:
    return [t for t in outputs(result) if t.dtype.is_floating_point and t.dtype.itemsize > 1 and t.requires_grad]
