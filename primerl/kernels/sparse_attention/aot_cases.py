"""AOT cases (:mod:`primerl.kernels.aot`) of the DeepSeek-sparse-attention and MLA kernels at
GLM-5 / DeepSeek-V3 shapes: the indexer over two 4096-token sequences (32 heads x 128), sparse
attention in GLM-5's absorbed form (64 heads over one 576-wide latent key, 512-wide values, 2048
selected keys per query), the two-width dense kernels at DeepSeek-V3's 192/128, and the square
op's Triton backend at the MLA widths the padded form runs (192 = DeepSeek-V3's 128 + 64 with V
padded from 128, what ring attention runs under context parallelism; 256 = GLM-5's 192 + 64),
which above head dim 128 runs the two-part kernels of ``attention/mla_triton.py``."""

from __future__ import annotations

import torch

from ..aot_case import Case

BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
T_SPARSE, K_SELECT = 4096, 2048


def _cuda(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def _indexer():
    from . import triton as st

    cu = _cuda(3, dtype=I32)
    st.indexer_scores_chunk(_cuda(8192, 32, 128), _cuda(8192, 128), _cuda(8192, 32, dtype=F32), cu, 4096, 0, 8192,
                            128 ** -0.5)


def _sparse(hq, hkv, dqk, dv, backward, fused=False):
    from . import triton as st

    def run():
        T = T_SPARSE
        q, k, v, idx = _cuda(T, hq, dqk), _cuda(T, hkv, dqk), _cuda(T, hkv, dv), _cuda(T, K_SELECT, dtype=I32)
        if fused:  # the model's absorbed form: values are the keys' first dv columns
            v = k[..., :dv]
        if backward:
            st.sparse_backward(_cuda(T, hq, dv), q, k, v, idx, _cuda(T, hq, dv), _cuda(hq, T, dtype=F32), None, 0.04,
                               fuse_kv=fused)
        else:
            st.sparse_forward(q, k, v, idx, 0.04, BF16)

    return run


def _padded_mla(d, backward):
    from ..attention import AttentionSpec
    from ..attention import triton as at

    def run():
        t = 2 * 4096
        cu = _cuda(3, dtype=I32)
        spec = AttentionSpec(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, softmax_scale=d ** -0.5, q_positions=None,
                             k_positions=None, max_seqlen_q=4096, max_seqlen_k=4096)
        q, k, v = _cuda(t, 16, d), _cuda(t, 16, d), _cuda(t, 16, d)
        if backward:
            at.backward(_cuda(t, 16, d), q, k, v, _cuda(t, 16, d), _cuda(16, t, dtype=F32), None, spec)
        else:
            at.forward(q, k, v, spec, BF16)

    return run


def _native_mla(dqk, dv, backward):
    from ..attention import AttentionSpec
    from ..attention import mla_triton

    def run():
        t = 2 * 4096
        cu = _cuda(3, dtype=I32)
        spec = AttentionSpec(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, softmax_scale=dqk ** -0.5,
                             q_positions=None, k_positions=None, max_seqlen_q=4096, max_seqlen_k=4096)
        q, k, v = _cuda(t, 16, dqk), _cuda(t, 16, dqk), _cuda(t, 16, dv)
        if backward:
            mla_triton.backward(_cuda(t, 16, dv), q, k, v, _cuda(t, 16, dv), _cuda(16, t, dtype=F32), None, spec)
        else:
            mla_triton.forward(q, k, v, spec, BF16)

    return run


GLM5 = f"T={T_SPARSE} K={K_SELECT} Hq=64 Hkv=1 Dqk=576 Dv=512"
CASES = [
    Case("dsa indexer scores T=2x4096 Hi=32 Di=128", _indexer, "bf16", ci=True),
    Case(f"sparse attention fwd (absorbed MLA) {GLM5}", _sparse(64, 1, 576, 512, False), "bf16", ci=True),
    Case(f"sparse attention bwd (absorbed MLA, fused dKV) {GLM5}", _sparse(64, 1, 576, 512, True, True), "bf16",
         ci=True),
    Case(f"sparse attention bwd (separate K, V) {GLM5}", _sparse(64, 1, 576, 512, True), "bf16"),
    Case("mla attention fwd (native) T=2x4096 H=16 Dqk=192 Dv=128", _native_mla(192, 128, False), "bf16", ci=True),
    Case("mla attention bwd (native) T=2x4096 H=16 Dqk=192 Dv=128", _native_mla(192, 128, True), "bf16", ci=True),
    # 256/256 (GLM-5's dense form) is square: mla_attention runs the square op, whose Triton
    # backend runs these same two-part kernels above head dim 128 (the cases below compile alike).
    Case("mla attention fwd (native) T=2x4096 H=16 Dqk=256 Dv=256", _native_mla(256, 256, False), "bf16"),
    Case("mla attention bwd (native) T=2x4096 H=16 Dqk=256 Dv=256", _native_mla(256, 256, True), "bf16"),
    Case("mla attention fwd (V padded) T=2x4096 H=16 D=192", _padded_mla(192, False), "bf16", ci=True),
    Case("mla attention fwd T=2x4096 H=16 D=256", _padded_mla(256, False), "bf16", ci=True),
    # The square kernels with one 256-wide tile spilled here (2026-12-04, triton 3.7.1: dK/dV
    # 142-172, dQ 90-133 local loads-stores); the two-part kernels are clean (bench/RESULTS.md).
    Case("mla attention bwd (V padded) T=2x4096 H=16 D=192", _padded_mla(192, True), "bf16", ci=True),
    Case("mla attention bwd T=2x4096 H=16 D=256", _padded_mla(256, True), "bf16", ci=True),
]
