"""Sizes the kernels choose from shapes alone, in plain Python (no torch): the kernels use them, and
``primerl plan`` / ``primerl rl --dry-run`` (``runtime.memory_plan``) model the same choices without
loading torch. Re-exported where the kernels use them: ``kernels.logprobs.chunked.default_chunk_sizes``,
``kernels.moe.cpu_experts.MIN_BYTES``."""

from __future__ import annotations

# Below this many bytes of the widest [rows, D or 2I] activation, the op-by-op chain is as fast or
# faster (its full-size buffers are heap-recycled, no page faults to save; this path's Python loop
# costs more ops per expert). Measured on 2 cores, fwd+bwd, by-expert / chain time: 0.5 MB 1.30,
# 4 MB 1.00-1.07, 17 MB 0.81-0.99, 32 MB (the bench's small shape) 0.85.
CPU_EXPERTS_MIN_BYTES = 1 << 24


def default_chunk_sizes(T: int, V: int, D: int, native: bool) -> tuple[int, int, int]:
    """(tokens per logits block, vocabulary rows per block, tokens per gradient block).

    bf16/fp16 tensor-core GEMMs (``native``): backward holds a [T, D] float32 grad_hidden
    accumulator (4 T D bytes); the blocks may add half that (at least 64 MiB): a float32 logits
    block [Tz, Vc] (4 Tz Vc), a bf16 gradient block [Td, Vc] that the two gradient GEMMs read
    (2 Td Vc) and, when Td < T, a [Vc, D] float32 weight-gradient accumulator. Among the fits, the
    least accumulator traffic: each vocabulary chunk re-reads and re-writes grad_hidden (8 T D
    bytes against 2 T D Vc flops: intensity Vc / 4 flop/byte), each gradient block the weight
    accumulator (8 V D bytes per block); with Td = T the weight gradient of a vocabulary chunk is
    one GEMM written once. Ties: the larger logits block (fewer, larger GEMMs; Tz <= 4096).
    At (T, D, V) = (16384, 4096, 151936): (4096, 2048, T), blocks 101 MB; (32768, 6144, 154880):
    (4096, 4096, T), 336 MB. An H200 does ~700 TFLOP/s against ~4 TB/s: above intensity ~500
    the accumulator traffic overlaps the GEMMs' arithmetic.
    Otherwise (float32 GEMMs, CPU): 1024 x 8192 blocks, as measured on CPU.
    """
    if not native or T == 0:
        return 1024, 8192, 1024
    budget = max(2 * T * D, 64 << 20)
    best = None
    for vc in sorted({min(v, V) for v in (8192, 4096, 2048, 1024, 512)}, reverse=True):
        for tz in sorted({min(t, T) for t in (4096, 2048, 1024)}, reverse=True):
            for td in sorted({T, tz}, reverse=True):
                mem = 4 * tz * vc + 2 * td * vc + (4 * vc * D if td < T else 0)
                if mem > budget:
                    continue
                traffic = 8 * T * D * -(-V // vc) + (8 * V * D * -(-T // td) if td < T else 0)
                key = (traffic, -tz * vc)
                if best is None or key < best[0]:
                    best = (key, (tz, vc, td))
    if best is None:
        return min(T, 1024), min(V, 512), min(T, 1024)
    return best[1]
