"""Representative calls of every Triton launcher, for :mod:`.aot` (compiled ahead of time for the
GPU at the configuration the launcher picks). Each case makes its inputs with ``device="cuda"``
(storage-less stand-ins under :func:`.aot.capture_launches`) and calls the public op with
``backend="triton"`` (quantization, GEMMs) or the launcher in ``<family>/triton.py`` (MoE,
attention, log-probs internals).

Shapes: DeepGEMM's benchmark GEMMs (M in {128, 4096}, N x K in {2112 x 7168, 7168 x 2048,
4096 x 7168}; grouped: 4-8 groups at N x K = 4096 x 7168), FP8 quantization at K = 7168, MoE with
8 of 256 experts over 4096 tokens at hidden 7168 / intermediate 2048, attention over two causal
4096-token sequences with GQA (32 query / 4 KV heads at head_dim 128, 16 / 2 at 64), log-probs at
T = 16384, D = 4096, V = 151936 (bf16 and float32) with the chunk sizes the public op picks.
``ci=True`` marks the subset the test suite compiles: one case per kernel and per distinct tile
configuration.
"""

from __future__ import annotations

import functools

import torch

from .aot_case import Case

E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16
F32 = torch.float32
I32 = torch.int32

GEMM_NK = [(2112, 7168), (7168, 2048), (4096, 7168)]
GEMM_M = [128, 4096]
CI_GEMMS = {(128, 2112, 7168), (4096, 7168, 2048)}  # one of each tile configuration (BN 64 / 128)
GROUPED_NK = (4096, 7168)


def _cuda(*shape, dtype=BF16, requires_grad=False):
    return torch.empty(*shape, dtype=dtype, device="cuda", requires_grad=requires_grad)


def _act(m, k):
    """(q [m, k] e4m3, sf [m, k/128] float32): per-token-group FP8 activations."""
    return _cuda(m, k, dtype=E4M3), _cuda(m, -(-k // 128), dtype=F32)


def _weight(g, n, k):
    """(q [g, n, k] e4m3, sf [g, n/128, k/128] float32): per-block FP8 weights."""
    return _cuda(g, n, k, dtype=E4M3), _cuda(g, -(-n // 128), -(-k // 128), dtype=F32)


def _offsets(groups, rows_per_group):
    return _cuda(groups, dtype=I32)


# ------------------------------------------------------------------------------ FP8 quantization
# Quantization and GEMMs go through the public ops with backend="triton" (DeepGEMM's names and
# arguments: the stable interface); content checks that would read values run only on CPU tensors.

T = "triton"


def _quant_cases():
    from . import fp8
    from . import gemm

    return [
        Case("fp8 per-token-group 4096x7168 g128",
             lambda: fp8.quant_per_token_group(_cuda(4096, 7168), 128, backend=T), None, ci=True),
        Case("fp8 per-token-group 4096x7168 g128 ue8m0",
             lambda: fp8.quant_per_token_group(_cuda(4096, 7168), 128, ue8m0=True, backend=T), None),
        Case("fp8 rowwise 4096x7168", lambda: fp8.quant_rowwise(_cuda(4096, 7168), backend=T), None),
        Case("fp8 per-block 2112x7168 128x128", lambda: fp8.quant_per_block(_cuda(2112, 7168), backend=T), None,
             ci=True),
        Case("fp8 per-block 8x4096x7168 ue8m0",
             lambda: fp8.quant_per_block(_cuda(8, 4096, 7168), ue8m0=True, backend=T), None),
        Case("fp8 tensorwise 4096x7168", lambda: fp8.quant_tensorwise(_cuda(4096, 7168), backend=T), None, ci=True),
        Case("fp8 per-group colwise T=4x2048 C=7168",
             lambda: gemm.quant_per_group_colwise(_cuda(4 * 2048, 7168), _offsets(4, 2048), backend=T), None, ci=True),
        Case("fp8 per-group colwise T=4x2048 C=7168 group blocks",
             lambda: gemm.quant_per_group_colwise(_cuda(4 * 2048, 7168), _offsets(4, 2048), layout="blocks", backend=T),
             None, ci=True),
    ]


# ------------------------------------------------------------------------------ GEMMs


def _bf16_dense_fwd_bwd(m, n, k):
    from . import gemm

    a, b = _cuda(m, k, requires_grad=True), _cuda(n, k, requires_grad=True)
    gemm.gemm_nt(a, b, backend=T).backward(_cuda(m, n))


def _bf16_grouped_fwd_bwd(groups, rows, n, k):
    from . import gemm

    a, b = _cuda(groups * rows, k, requires_grad=True), _cuda(groups, n, k, requires_grad=True)
    gemm.grouped_gemm_nt(a, b, _offsets(groups, rows), layout="offsets", backend=T).backward(_cuda(groups * rows, n))


def _fp8_dense(m, n, k):
    from . import gemm

    gemm.fp8_gemm_nt(_act(m, k), tuple(t[0] for t in _weight(1, n, k)), out_dtype=BF16, backend=T)


def _fp8_dense_row_scaled_b(m, n, k):
    from . import gemm

    b = (_cuda(n, k, dtype=E4M3), _cuda(n, k // 128, dtype=F32))  # one scale per row of B (SM100's 1D1D)
    gemm.fp8_gemm_nt(_act(m, k), b, recipe=(1, 1, 128), out_dtype=BF16, backend=T)


def _fp8_dense_plus_c(m, n, k):
    from . import gemm

    d = _cuda(m, n, dtype=F32)
    gemm.fp8_gemm_nt(_act(m, k), tuple(t[0] for t in _weight(1, n, k)), d, c=d, backend=T)


def _fp8_contiguous(groups, m, n, k):
    from . import gemm

    gemm.m_grouped_fp8_gemm_nt_contiguous(_act(m, k), _weight(groups, n, k), _cuda(m, dtype=I32), out_dtype=BF16,
                                          backend=T)


def _fp8_offsets(groups, rows, n, k):
    from . import gemm

    gemm.m_grouped_fp8_gemm_nt_offsets(_act(groups * rows, k), _weight(groups, n, k), _offsets(groups, rows),
                                       out_dtype=BF16, backend=T)


def _fp8_masked(groups, max_m, expected_m, n, k):
    from . import gemm

    a = (_cuda(groups, max_m, k, dtype=E4M3), _cuda(groups, max_m, k // 128, dtype=F32))
    gemm.m_grouped_fp8_gemm_nt_masked(a, _weight(groups, n, k), _cuda(groups, dtype=I32), expected_m, out_dtype=BF16,
                                      backend=T)


def _fp8_k_grouped(groups, t, n, k):
    from . import gemm
    from .gemm.offsets import max_group_blocks

    blocks = max_group_blocks(t, groups)
    gemm.k_grouped_fp8_gemm_tn_contiguous((_cuda(t, n, dtype=E4M3), _cuda(blocks, n, dtype=F32)),
                                          (_cuda(t, k, dtype=E4M3), _cuda(blocks, k, dtype=F32)),
                                          _offsets(groups, t // groups), out_dtype=F32, backend=T)


def _fp8_k_grouped_blocks_plus_c(groups, t, n, k):
    """Group-blocks operands (layout="blocks") and a float32 C added in place (d = c)."""
    from . import gemm
    from .gemm.offsets import max_group_blocks

    blocks = max_group_blocks(t, groups)
    d = _cuda(groups, n, k, dtype=F32)
    gemm.k_grouped_fp8_gemm_tn_contiguous((_cuda(blocks, n, 128, dtype=E4M3), _cuda(blocks, n, dtype=F32)),
                                          (_cuda(blocks, k, 128, dtype=E4M3), _cuda(blocks, k, dtype=F32)),
                                          _offsets(groups, t // groups), d=d, c=d, backend=T)


def _gemm_cases():
    P = functools.partial
    cases = []
    for m in GEMM_M:
        for n, k in GEMM_NK:
            ci = (m, n, k) in CI_GEMMS
            cases.append(Case(f"fp8 gemm nt M={m} N={n} K={k}", P(_fp8_dense, m, n, k), "fp8", ci))
            cases.append(Case(f"bf16 gemm nt fwd+bwd M={m} N={n} K={k}", P(_bf16_dense_fwd_bwd, m, n, k), "bf16",
                              ci and m == 4096))
    m, n, k = 4096, 7168, 2048
    cases.append(Case(f"fp8 gemm nt recipe (1,1,128) M={m} N={n} K={k}", P(_fp8_dense_row_scaled_b, m, n, k), "fp8",
                      True))
    cases.append(Case(f"fp8 gemm nt + c float32 M={m} N={n} K={k}", P(_fp8_dense_plus_c, m, n, k), "fp8", True))
    n, k = GROUPED_NK
    for groups, rows in [(4, 8192), (8, 4096)]:
        m = groups * rows
        cases.append(Case(f"fp8 m-grouped contiguous G={groups} M={m} N={n} K={k}", P(_fp8_contiguous, groups, m, n, k),
                          "fp8", groups == 4))
        cases.append(Case(f"fp8 m-grouped offsets G={groups} M={m} N={n} K={k}", P(_fp8_offsets, groups, rows, n, k),
                          "fp8", groups == 8))
    for groups, max_m, expected_m in [(4, 256, 256), (8, 128, 64)]:
        cases.append(Case(f"fp8 m-grouped masked G={groups} max_m={max_m} expected_m={expected_m} N={n} K={k}",
                          P(_fp8_masked, groups, max_m, expected_m, n, k), "fp8", expected_m == 64))
    for groups, rows in [(4, 2048), (8, 1024)]:
        t = groups * rows
        cases.append(Case(f"fp8 k-grouped tn G={groups} T={t} N={n} K={k}", P(_fp8_k_grouped, groups, t, n, k), "fp8",
                          groups == 4))
    cases.append(Case(f"fp8 k-grouped tn group blocks + c float32 G=4 T={4 * 2048} N={n} K={k}",
                      P(_fp8_k_grouped_blocks_plus_c, 4, 4 * 2048, n, k), "fp8"))
    cases.append(Case(f"bf16 m-grouped offsets fwd+bwd G=8 M={8 * 4096} N={n} K={k}",
                      P(_bf16_grouped_fwd_bwd, 8, 4096, n, k), "bf16", True))
    return cases


# ------------------------------------------------------------------------------ MoE

MOE_T, MOE_TOPK, MOE_E, MOE_D, MOE_I = 4096, 8, 256, 7168, 2048


def _moe_cases():
    from .moe import triton as mt
    from .moe.reference import max_padded_rows

    rows = max_padded_rows(MOE_T * MOE_TOPK, MOE_E, 128)
    row_map = lambda: _cuda(MOE_T, MOE_TOPK, dtype=I32)  # noqa: E731
    return [
        Case(f"moe align T={MOE_T} topk={MOE_TOPK} E={MOE_E} block 128",
             lambda: mt.align(_cuda(MOE_T, MOE_TOPK, dtype=torch.int64), MOE_E, 128), None, ci=True),
        Case(f"moe scatter rows D={MOE_D}", lambda: mt.scatter_rows(_cuda(MOE_T, MOE_D), row_map(), None, rows), None,
             ci=True),
        Case(f"moe scatter rows scaled D={MOE_D}",
             lambda: mt.scatter_rows(_cuda(MOE_T, MOE_D), row_map(), _cuda(MOE_T, MOE_TOPK, dtype=F32), rows), None),
        Case(f"moe combine rows weighted D={MOE_D}",
             lambda: mt.combine_rows(_cuda(rows, MOE_D), row_map(), _cuda(MOE_T, MOE_TOPK, dtype=F32)), None, ci=True),
        Case(f"moe swiglu rows={rows} I={MOE_I}", lambda: mt.swiglu(_cuda(rows, 2 * MOE_I)), None, ci=True),
        Case(f"moe swiglu backward rows={rows} I={MOE_I}",
             lambda: mt.swiglu_backward(_cuda(rows, 2 * MOE_I), _cuda(rows, MOE_I)), None, ci=True),
        Case(f"moe swiglu+quant rows={rows} I={MOE_I} g128",
             lambda: mt.swiglu_quant(_cuda(rows, 2 * MOE_I), 128, E4M3, False), None, ci=True),
    ]


# ------------------------------------------------------------------------------ attention


def _attention_spec(seqs: int, seqlen: int, causal: bool = True):
    from .attention import AttentionSpec

    cu = _cuda(seqs + 1, dtype=I32)
    return AttentionSpec(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal, softmax_scale=0.088, q_positions=None,
                         k_positions=None, max_seqlen_q=seqlen, max_seqlen_k=seqlen)


def _attention_cases():
    from .attention import triton as at

    cases = []
    # non-causal blocks are what a ring step against earlier chunks runs (a different loop to pipeline)
    for hq, hkv, d, causal, ci in [(32, 4, 128, True, True), (16, 2, 64, True, False), (32, 4, 128, False, True)]:
        t = 2 * 4096

        def fwd(hq=hq, hkv=hkv, d=d, causal=causal):
            at.forward(_cuda(t, hq, d), _cuda(t, hkv, d), _cuda(t, hkv, d), _attention_spec(2, 4096, causal), BF16)

        def bwd(hq=hq, hkv=hkv, d=d, causal=causal):
            at.backward(_cuda(t, hq, d), _cuda(t, hq, d), _cuda(t, hkv, d), _cuda(t, hkv, d), _cuda(t, hq, d),
                        _cuda(hq, t, dtype=F32), None, _attention_spec(2, 4096, causal))

        shape = f"T=2x4096 {'causal' if causal else 'full'} Hq={hq} Hkv={hkv} D={d}"
        cases += [Case(f"attention fwd {shape}", fwd, "bf16", ci),
                  Case(f"attention bwd (dk/dv, dq) {shape}", bwd, "bf16", ci)]
    cases.append(Case("attention merge states T=8192 H=32 D=128", lambda: at.merge_attn_states(
        _cuda(8192, 32, 128), _cuda(32, 8192, dtype=F32), _cuda(8192, 32, 128), _cuda(32, 8192, dtype=F32),
        inplace=False), None, ci=True))
    return cases


# ------------------------------------------------------------------------------ log-probs

LP_T, LP_D, LP_V = 16384, 4096, 151936


def _logprobs_cases():
    from .logprobs import chunked
    from .logprobs.triton import TritonChunkOps

    def fwd_bwd(dtype, temperature):
        # the chunk sizes fused_logprobs picks for these tensors (bf16: the tensor-core path)
        hidden, weight = _cuda(LP_T, LP_D, dtype=dtype), _cuda(LP_V, LP_D, dtype=dtype)
        targets = _cuda(LP_T, dtype=torch.int64)
        tz, vc, td = chunked.default_chunk_sizes(LP_T, LP_V, LP_D, chunked.native_low_precision(hidden, weight))
        inv_temp, unit = (_cuda(LP_T, dtype=F32), False) if temperature else (None, True)
        lp, ent, stats = chunked.chunked_forward(hidden, weight, targets, inv_temp, unit, tz, vc, True, TritonChunkOps)
        chunked.chunked_backward(hidden, weight, targets, inv_temp, unit, lp, ent, stats, _cuda(LP_T, dtype=F32),
                                 _cuda(LP_T, dtype=F32), tz, vc, td, True, True, TritonChunkOps)

    shape = f"T={LP_T} D={LP_D} V={LP_V} entropy"
    return [Case(f"logprobs fwd+bwd bf16 {shape} per-token temperature", functools.partial(fwd_bwd, BF16, True), None,
                 ci=True),
            Case(f"logprobs fwd+bwd float32 {shape}", functools.partial(fwd_bwd, F32, False), None, ci=True)]


def all_cases() -> list[Case]:
    from .lora.aot_cases import CASES as lora_cases  # LoRA shrink / expand, dense and grouped
    from .sparse_attention.aot_cases import CASES as sparse_attention_cases  # DSA and MLA shapes

    return _quant_cases() + _gemm_cases() + _moe_cases() + _attention_cases() + _logprobs_cases() \
        + sparse_attention_cases + lora_cases
