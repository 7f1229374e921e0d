"""fused_logprobs (chunked torch and Triton per-chunk kernels) against the full-logits reference.

Oracle: ``logprobs_reference`` evaluated in float64 on the same float32 inputs (the float32
reference itself is off by up to 1e-2 relative on peaked distributions, where 1 - p and
lse - E[z] cancel; the chunked path avoids both). Metric: max_rel_err = max|a - e| / max|e|;
threshold 1e-5 for logprobs, entropies and the gradients w.r.t. hidden and weight.

bf16/fp16 inputs (the tensor-core path on CUDA, emulated on CPU by exact upcasts): logprobs and
entropies within 1e-3 absolute of the float64 reference on the same low-precision values; the
gradients within one epsilon of the dtype relative to their scale (the gradient block and the
result are each rounded once to the dtype; measured 1.5-4.6e-3 for bf16, whose epsilon is 7.8e-3).
"""

import zlib

import pytest
import torch

from primerl.kernels.logprobs import fused_logprobs, logprobs_reference
from primerl.kernels.logprobs import chunked
from primerl.kernels.testing import max_rel_err

BACKENDS = ["torch", "triton"]
# (T, V, D, chunk_size, vocab_chunk_size): single chunk, ragged multi-chunk, primes, length 1
CASES = [
    (1, 7, 5, 4, 4),
    (13, 97, 24, 5, 16),
    (37, 101, 16, 8, 32),
    (16, 64, 8, 16, 64),
    (3, 1, 4, 2, 1),
]


def _inputs(T, V, D, seed, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * scale / D**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    return hidden, weight, targets, g


def _grads(logp, ent, hidden, weight, g_lp, g_ent):
    loss = (logp * g_lp.to(logp.dtype)).sum()
    if ent is not None:
        loss = loss + (ent * g_ent.to(ent.dtype)).sum()
    return torch.autograd.grad(loss, (hidden, weight))


def _check_against_oracle(logp, ent, hidden, weight, targets, temperature, seed, tol=1e-5):
    """Values and grads (of a random linear loss in logp and entropy) vs the float64 reference."""
    h64 = hidden.detach().double().requires_grad_(hidden.requires_grad)
    w64 = weight.detach().double().requires_grad_(weight.requires_grad)
    t64 = temperature.double() if isinstance(temperature, torch.Tensor) else temperature
    ref_lp, ref_ent = logprobs_reference(h64, w64, targets, t64, return_entropy=ent is not None)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    assert max_rel_err(logp.detach(), ref_lp.detach()) < tol
    if ent is not None:
        assert ent.dtype == torch.float32
        assert max_rel_err(ent.detach(), ref_ent.detach()) < tol
    g = torch.Generator().manual_seed(seed)
    g_lp = torch.randn(targets.shape, generator=g).to(targets.device)
    g_ent = torch.randn(targets.shape, generator=g).to(targets.device)
    wrt = [x for x in (hidden, weight) if x.requires_grad]
    wrt64 = [x for x in (h64, w64) if x.requires_grad]
    got = torch.autograd.grad((logp * g_lp).sum() + (0 if ent is None else (ent * g_ent).sum()), wrt)
    want = torch.autograd.grad((ref_lp * g_lp.double()).sum()
                               + (0 if ent is None else (ref_ent * g_ent.double()).sum()), wrt64)
    for a, e in zip(got, want):
        assert a.dtype == hidden.dtype
        assert max_rel_err(a, e) < tol


# The interpreter is slow: Triton runs the per-token temperature (the general case) only.
VALUE_CASES = [("torch", c, t) for c in CASES for t in ("one", "scalar", "per_token")]
VALUE_CASES += [("triton", c, "per_token") for c in CASES]


@pytest.mark.parametrize("backend,case,temperature", VALUE_CASES)
def test_values_and_grads_match_reference(backend, case, temperature):
    T, V, D, tc, vc = case
    seed = zlib.crc32(repr((T, V, D, temperature)).encode())
    hidden, weight, targets, g = _inputs(T, V, D, seed, scale=3.0)
    temp = {"one": 1.0, "scalar": 0.7, "per_token": torch.rand(T, generator=g) + 0.3}[temperature]
    logp, ent = fused_logprobs(hidden, weight, targets, temperature=temp, chunk_size=tc,
                               vocab_chunk_size=vc, backend=backend)
    _check_against_oracle(logp, ent, hidden, weight, targets, temp, seed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_entropy_gradient_of_logprobs_only(backend):
    hidden, weight, targets, g = _inputs(11, 53, 12, seed=3)
    logp, ent = fused_logprobs(hidden, weight, targets, return_entropy=False, chunk_size=4,
                               vocab_chunk_size=16, backend=backend)
    assert ent is None
    _check_against_oracle(logp, None, hidden, weight, targets, 1.0, seed=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_peaked_logits_stay_finite_and_accurate(backend):
    # Logit scale ~ 60: probabilities near one-hot, entropies down to 1e-20, 1 - p cancels in a
    # naive float32 computation; exercises the rescaling and the cancellation-free forms.
    hidden, weight, targets, g = _inputs(9, 40, 8, seed=5, scale=150.0)
    logp, ent = fused_logprobs(hidden, weight, targets, chunk_size=4, vocab_chunk_size=8, backend=backend)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    _check_against_oracle(logp, ent, hidden, weight, targets, 1.0, seed=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_one_input_requires_grad(backend):
    hidden, weight, targets, _ = _inputs(6, 30, 8, seed=7)
    hidden.requires_grad_(False)
    logp, ent = fused_logprobs(hidden, weight, targets, chunk_size=4, vocab_chunk_size=8, backend=backend)
    _check_against_oracle(logp, ent, hidden, weight, targets, 1.0, seed=3)


def test_triton_kernels_with_many_small_tiles(monkeypatch):
    # 2x4 tiles: several programs per chunk and several online-softmax steps inside one program
    import primerl.kernels.logprobs.triton as tk

    monkeypatch.setattr(tk, "_FORCE_BLOCKS", (2, 4))
    hidden, weight, targets, g = _inputs(7, 29, 8, seed=13, scale=4.0)
    temp = torch.rand(7, generator=g) + 0.5
    logp, ent = fused_logprobs(hidden, weight, targets, temperature=temp, chunk_size=5, vocab_chunk_size=13,
                               backend="triton")
    _check_against_oracle(logp, ent, hidden, weight, targets, temp, seed=6)


def test_gradient_of_entropy_alone():
    hidden, weight, targets, _ = _inputs(5, 20, 8, seed=9)
    logp, ent = fused_logprobs(hidden, weight, targets, chunk_size=2, vocab_chunk_size=8)
    (gh,) = torch.autograd.grad(ent.sum(), (hidden,), retain_graph=True)  # entropy only
    ref_lp, ref_ent = logprobs_reference(hidden, weight, targets)
    (rh,) = torch.autograd.grad(ref_ent.sum(), (hidden,))
    assert max_rel_err(gh, rh) < 1e-4


def test_bf16_inputs_match_reference_and_keep_dtype():
    hidden, weight, targets, g = _inputs(10, 70, 16, seed=11, dtype=torch.bfloat16)
    logp, ent = fused_logprobs(hidden, weight, targets, chunk_size=4, vocab_chunk_size=32)
    ref_lp, ref_ent = logprobs_reference(hidden, weight, targets)
    # both upcast the same bf16 values to float32, so the values agree to float32 accuracy
    assert max_rel_err(logp.detach(), ref_lp.detach()) < 1e-5
    assert max_rel_err(ent.detach(), ref_ent.detach()) < 1e-5
    g_lp, g_ent = torch.randn(10, generator=g), torch.randn(10, generator=g)
    gh, gw = _grads(logp, ent, hidden, weight, g_lp, g_ent)
    rh, rw = _grads(ref_lp, ref_ent, hidden, weight, g_lp, g_ent)
    assert gh.dtype == gw.dtype == torch.bfloat16
    assert max_rel_err(gh, rh) < 1e-2 and max_rel_err(gw, rw) < 1e-2  # one bf16 rounding each


def _check_low_precision(logp, ent, hidden, weight, targets, temperature, seed):
    """bf16/fp16 contract: values within 1e-3 absolute, gradients within eps(dtype) relative to scale."""
    dtype = hidden.dtype
    h64 = hidden.detach().double().requires_grad_(hidden.requires_grad)
    w64 = weight.detach().double().requires_grad_(weight.requires_grad)
    t64 = temperature.double() if isinstance(temperature, torch.Tensor) else temperature
    ref_lp, ref_ent = logprobs_reference(h64, w64, targets, t64)
    assert logp.dtype == ent.dtype == torch.float32
    assert float((logp.detach().double() - ref_lp.detach()).abs().max()) < 1e-3
    assert float((ent.detach().double() - ref_ent.detach()).abs().max()) < 1e-3
    g = torch.Generator().manual_seed(seed)
    g_lp = torch.randn(targets.shape, generator=g).to(targets.device)
    g_ent = torch.randn(targets.shape, generator=g).to(targets.device)
    wrt = [x for x in (hidden, weight) if x.requires_grad]
    wrt64 = [x for x in (h64, w64) if x.requires_grad]
    got = torch.autograd.grad((logp * g_lp).sum() + (ent * g_ent).sum(), wrt)
    want = torch.autograd.grad((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum(), wrt64)
    for a, e in zip(got, want):
        assert a.dtype == dtype
        assert max_rel_err(a, e) < torch.finfo(dtype).eps


# backend=None is what a user gets: "torch" on CPU. The Triton kernels run in the interpreter.
@pytest.mark.parametrize("backend", [None, "torch", "triton"])
@pytest.mark.parametrize("dtype,temperature", [(torch.bfloat16, "one"), (torch.bfloat16, "per_token"),
                                               (torch.float16, "scalar")])
def test_low_precision_at_full_vocabulary(backend, dtype, temperature):
    # V = 151936 (Qwen's LM head): the log-sum-exp over 152k logits stays within 1e-3
    T, V, D = 6, 151936, 32
    seed = zlib.crc32(repr((backend, dtype, temperature)).encode())
    hidden, weight, targets, g = _inputs(T, V, D, seed, scale=3.0, dtype=dtype)
    temp = {"one": 1.0, "scalar": 0.7, "per_token": torch.rand(T, generator=g) + 0.3}[temperature]
    logp, ent = fused_logprobs(hidden, weight, targets, temperature=temp, backend=backend)
    _check_low_precision(logp, ent, hidden, weight, targets, temp, seed)


# (T, V, D, chunk_size, vocab_chunk_size): several token chunks (float32 weight-gradient
# accumulator), one token chunk (the weight gradient written by one GEMM), ragged, length 1
LOWP_CASES = [(13, 97, 24, 5, 16), (13, 97, 24, 13, 40), (37, 101, 16, 64, 32), (1, 7, 8, 4, 4)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", LOWP_CASES)
def test_low_precision_chunking(backend, case):
    T, V, D, tc, vc = case
    seed = zlib.crc32(repr((backend, case)).encode())
    hidden, weight, targets, g = _inputs(T, V, D, seed, scale=4.0, dtype=torch.bfloat16)
    temp = torch.rand(T, generator=g) + 0.3
    logp, ent = fused_logprobs(hidden, weight, targets, temperature=temp, chunk_size=tc, vocab_chunk_size=vc,
                               backend=backend)
    _check_low_precision(logp, ent, hidden, weight, targets, temp, seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_low_precision_one_input_requires_grad(backend, which):
    hidden, weight, targets, g = _inputs(9, 50, 16, seed=17, scale=3.0, dtype=torch.bfloat16)
    (weight if which == "hidden" else hidden).requires_grad_(False)
    logp, ent = fused_logprobs(hidden, weight, targets, temperature=0.8, chunk_size=4, vocab_chunk_size=16,
                               backend=backend)
    _check_low_precision(logp, ent, hidden, weight, targets, 0.8, seed=4)


def test_low_precision_gradient_block_is_rounded_like_the_gpu(monkeypatch):
    # CPU emulation of the tensor-core path: the gradient GEMMs see dz rounded to bf16, not float32
    seen = []
    real = chunked._gemm

    def spy(out, a, b, accumulate=False):
        seen.append(a)
        return real(out, a, b, accumulate)

    monkeypatch.setattr(chunked, "_gemm", spy)
    hidden, weight, targets, _ = _inputs(5, 20, 8, seed=3, dtype=torch.bfloat16)
    logp, ent = fused_logprobs(hidden, weight, targets, chunk_size=5, vocab_chunk_size=20)
    seen.clear()
    logp.sum().backward()
    grads = seen[1:]  # after the logits GEMM: dz @ W and dz^T @ h
    assert len(grads) == 2 and all(a.dtype == torch.float32 for a in grads)  # upcast on CPU ...
    assert all(torch.equal(a, a.bfloat16().float()) for a in grads)  # ... of bf16 values


# (chunk_size, vocab_chunk_size, grad_chunk_size) as the CUDA policy may pick them: gradient blocks
# spanning T filled by several (ragged) logits blocks, or spanning some of T (weight accumulator)
POLICIES = [(5, 16, 13), (4, 40, 9), (13, 97, 13)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gradient_blocks_of_several_logits_blocks(backend, policy, dtype, monkeypatch):
    monkeypatch.setattr(chunked, "default_chunk_sizes", lambda T, V, D, native: policy)
    T, V, D = 13, 97, 24
    seed = zlib.crc32(repr((backend, policy, dtype)).encode())
    hidden, weight, targets, g = _inputs(T, V, D, seed, scale=4.0, dtype=dtype)
    temp = torch.rand(T, generator=g) + 0.3
    logp, ent = fused_logprobs(hidden, weight, targets, temperature=temp, backend=backend)
    if dtype == torch.float32:
        _check_against_oracle(logp, ent, hidden, weight, targets, temp, seed)
    else:
        _check_low_precision(logp, ent, hidden, weight, targets, temp, seed)


@pytest.mark.parametrize("T,D,V", [(16384, 4096, 151936), (32768, 6144, 154880), (1024, 1024, 32000),
                                   (1, 64, 1000), (65536, 1024, 151936), (131072, 8192, 262144)])
def test_default_chunks_bound_the_blocks(T, D, V):
    tz, vc, td = chunked.default_chunk_sizes(T, V, D, native=True)
    assert 1 <= tz <= td <= T and 1 <= vc <= V
    block_bytes = 4 * tz * vc + 2 * td * vc + (4 * vc * D if td < T else 0)
    assert block_bytes <= max(2 * T * D, 64 << 20)  # at most half the [T, D] float32 accumulator
    assert tz * vc < T * V or T * V * 6 <= 64 << 20  # never a [T, V] block unless it is tiny
    assert chunked.default_chunk_sizes(T, V, D, native=False) == (1024, 8192, 1024)


def _backward_peak(T, D, V, chunk_size, vocab_chunk_size, need):
    """Peak bytes allocated during one backward (bf16 inputs, CPU path), gradients of ``need``."""
    from bench.cpu_memory import track_peak_cpu_bytes

    hidden, weight, targets, g = _inputs(T, V, D, seed=5, dtype=torch.bfloat16)
    hidden.requires_grad_("hidden" in need)
    weight.requires_grad_("weight" in need)
    logp, _ = fused_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=chunk_size,
                             vocab_chunk_size=vocab_chunk_size, return_entropy=False, backend="torch")
    g_lp = torch.randn(T, generator=g)
    return track_peak_cpu_bytes(lambda: torch.autograd.backward(logp, g_lp))


def test_backward_peak_is_accumulator_plus_the_larger_of_blocks_and_the_rounded_copy():
    # grad_hidden is accumulated in float32 [T, D] (4 T D bytes) and rounded to bf16 at the end (a
    # 2 T D copy): the chunk blocks must be gone by then, or the peak is their sum (what the GPU
    # bench compares with Liger's). The blocks' bytes are measured as the weight-only backward holds
    # them (same loop, no grad_hidden); D is wide so that the rounded copy outweighs the blocks.
    T, D, V = 512, 2048, 1024
    blocks = _backward_peak(T, D, V, 64, 128, need=("weight",)) - 2 * V * D
    both = _backward_peak(T, D, V, 64, 128, need=("hidden", "weight"))
    assert 0 < blocks < 2 * T * D * 2
    assert both <= 2 * V * D + 4 * T * D + max(2 * T * D, blocks) + (64 << 10), (both, blocks)


def test_mm_out_dtype_is_detected():
    # torch 2.13 registers mm / addmm with out_dtype for meta (and CUDA) but has no CPU kernel
    assert chunked.has_mm_out_dtype("meta")
    assert not chunked.has_mm_out_dtype("cpu")
    h = torch.zeros(2, 4, dtype=torch.bfloat16)
    assert not chunked.native_low_precision(h, torch.zeros(3, 4, dtype=torch.bfloat16))  # CPU: emulated


def _cuda_inputs(T, V, D, seed, dtype):
    hidden, weight, targets, g = _inputs(T, V, D, seed, scale=4.0, dtype=dtype)
    temp = torch.rand(T, generator=g) + 0.5
    return (hidden.detach().cuda().requires_grad_(), weight.detach().cuda().requires_grad_(), targets.cuda(),
            temp.cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "torch", "triton"])
@pytest.mark.parametrize("chunks", ["default", "sub-blocks", "accumulated"])
@pytest.mark.parametrize("temperature", ["one", "per_token"])
def test_cuda_tensor_core_path_matches_oracle(backend, chunks, temperature, monkeypatch):
    # the H200 path: bf16 GEMMs with float32 logits blocks. "sub-blocks": gradient blocks over all
    # tokens filled by ragged logits blocks; "accumulated": gradient blocks of 300 tokens, the weight
    # gradient accumulated in float32 (addmm with out_dtype)
    if chunks == "sub-blocks":
        monkeypatch.setattr(chunked, "default_chunk_sizes", lambda T, V, D, native: (300, 3000, T))
    hidden, weight, targets, temp = _cuda_inputs(1024, 32000, 1024, seed=31, dtype=torch.bfloat16)
    temp = 1.0 if temperature == "one" else temp
    assert chunked.native_low_precision(hidden, weight)
    tc, vc = (300, 3000) if chunks == "accumulated" else (None, None)
    logp, ent = fused_logprobs(hidden, weight, targets, temperature=temp, chunk_size=tc, vocab_chunk_size=vc,
                               backend=backend)
    _check_low_precision(logp, ent, hidden, weight, targets, temp, seed=9)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_backward_peak_memory_is_accumulator_plus_blocks(backend):
    # the tensor-core path's memory contract (fused_logprobs docstring): above the gradients it
    # returns, backward holds the float32 [T, D] accumulator plus the larger of its blocks and the
    # rounded bf16 copy of grad_hidden
    T, D, V = 4096, 2048, 32000
    hidden, weight, targets, temp = _cuda_inputs(T, V, D, seed=41, dtype=torch.bfloat16)
    tz, vc, td = chunked.default_chunk_sizes(T, V, D, native=True)
    work = 4 * tz * vc if backend == "torch" else 0  # the plain-PyTorch chunk ops' second float32 block
    blocks = 4 * tz * vc + work + 2 * td * vc + (4 * vc * D if td < T else 0)
    g_lp = torch.randn(T, device="cuda")
    # a first step compiles the kernels and lets cuBLAS allocate its workspaces
    logp, _ = fused_logprobs(hidden, weight, targets, temperature=temp, return_entropy=False, backend=backend)
    torch.autograd.backward(logp, g_lp)
    hidden.grad = weight.grad = None
    logp, _ = fused_logprobs(hidden, weight, targets, temperature=temp, return_entropy=False, backend=backend)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.autograd.backward(logp, g_lp)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bound = 2 * V * D + 2 * T * D + 4 * T * D + max(2 * T * D, blocks) + (4 << 20)  # + [T] vectors, workspace
    assert peak <= bound, (peak, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_matches_oracle(backend, monkeypatch):
    hidden, weight, targets, g = _inputs(300, 5000, 128, seed=21, scale=4.0)
    temp = torch.rand(300, generator=g) + 0.5
    hidden = hidden.detach().cuda().requires_grad_()
    weight = weight.detach().cuda().requires_grad_()
    targets, temp = targets.cuda(), temp.cuda()
    # TF32 matmuls would round the logits to 10 mantissa bits
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    logp, ent = fused_logprobs(hidden, weight, targets, temperature=temp, chunk_size=128, vocab_chunk_size=1024,
                               backend=backend)
    _check_against_oracle(logp, ent, hidden, weight, targets, temp, seed=8)


def test_empty_batch():
    hidden = torch.zeros(0, 8, requires_grad=True)
    weight = torch.randn(5, 8, requires_grad=True)
    logp, ent = fused_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert logp.shape == ent.shape == (0,)
    logp.sum().backward()
    assert weight.grad.abs().sum() == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(targets=torch.tensor([0, 9])), r"targets must lie in \[0, 9\)"),
        (dict(targets=torch.tensor([0.0, 1.0])), "targets must be an integer"),
        (dict(targets=torch.tensor([0, 1, 2])), "targets must be an integer tensor of shape"),
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(temperature=torch.ones(3)), r"temperature must be a scalar or shape \(2,\)"),
        (dict(temperature=torch.tensor([1.0, -1.0])), "every temperature must be > 0"),
        (dict(weight=torch.randn(9, 3)), r"weight must be \[V, 4\]"),
        (dict(chunk_size=0), "chunk sizes must be None or integers >= 1"),
        (dict(backend="cuda"), "not implemented"),
    ],
)
def test_bad_input_raises(kwargs, match):
    args = dict(hidden=torch.randn(2, 4), weight=torch.randn(9, 4), targets=torch.tensor([0, 8]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fused_logprobs(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)
