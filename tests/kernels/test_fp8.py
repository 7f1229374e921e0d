"""primerl.kernels.fp8: reference properties, Triton/CUDA bitwise against the reference, validation.

On CPU the Triton kernels run under the interpreter (with primerl's corrections); the CUDA kernels
and Triton-on-GPU are covered by the ``gpu`` tests. A subprocess also compiles the Triton kernels
for sm_90 without a GPU and checks the PTX for IEEE division and the satfinite fp8 conversion.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
import torch

from primerl.kernels import BackendUnavailableError, HAS_CUDA_EXT, fp8, triton_interpreter_enabled
from primerl.kernels.fp8 import reference
from primerl.kernels.testing import assert_bitwise_equal

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
MIN_SUBNORMAL_EXP = {torch.float8_e4m3fn: -9, torch.float8_e5m2: -16}
CPU_TRITON = pytest.mark.skipif(not triton_interpreter_enabled(), reason="CPU Triton needs TRITON_INTERPRET=1")


def make_input(shape, dtype, seed):
    """Seeded normals with a per-row magnitude spread over the dtype's range, plus awkward rows:
    an all-zero row, a row of tiny (subnormal for float32) values, and the dtype's largest value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if x.dim() == 0:
        return (x * 3).to(dtype)
    rows = x.reshape(-1, x.shape[-1])
    lo, hi = (-3.0, 3.5) if dtype == torch.float16 else (-30.0, 35.0)
    rows *= 10 ** (torch.rand(rows.shape[0], 1, generator=g) * (hi - lo) + lo)
    if rows.shape[0] > 2:
        rows[0] = 0
        rows[1] = torch.randn(rows.shape[1], generator=g) * (1e-40 if dtype == torch.float32 else 1e-7)
        rows[2, -1] = torch.finfo(dtype).max
    fmax = torch.finfo(dtype).max
    return rows.clamp(-fmax, fmax).reshape(shape).to(dtype)


def check_same(op, *args, backend, **kwargs):
    q_ref, sf_ref = op(*args, backend="torch", **kwargs)
    q, sf = op(*args, backend=backend, **kwargs)
    assert_bitwise_equal(sf, sf_ref, "sf")
    assert_bitwise_equal(q, q_ref, "q")


# ---------------------------------------------------------------- reference properties


def _error_bound(x64: torch.Tensor, sf64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Half an fp8 ulp: relative 2^-(m+1) in the normal range, absolute half the subnormal step below.
    return x64.abs() * 2.0 ** -(MANTISSA_BITS[dtype] + 1) + sf64 * 2.0 ** (MIN_SUBNORMAL_EXP[dtype] - 1)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_reference_per_token_group_error_bound_and_scale(dtype, ue8m0):
    x = make_input((6, 512), torch.float32, seed=1)
    q, sf = fp8.quant_per_token_group(x, 128, dtype=dtype, ue8m0=ue8m0, backend="torch")
    assert q.dtype == dtype and sf.dtype == torch.float32 and sf.shape == (6, 4)
    fmax = float(torch.finfo(dtype).max)
    amax = x.reshape(6, 4, 128).abs().amax(-1).numpy().astype(np.float32)
    # sf formula, computed independently in numpy float32 (IEEE division)
    exact = np.maximum(amax, np.float32(1e-4)) / np.float32(fmax)
    if ue8m0:
        sf_np = sf.numpy()
        assert np.all(np.frexp(sf_np)[0] == 0.5), "ue8m0 scales must be powers of two"
        assert np.all(sf_np >= exact) and np.all(sf_np / 2 < exact), "ue8m0 must round up to the next power of two"
    else:
        np.testing.assert_array_equal(sf.numpy(), exact)
    x64 = x.double().reshape(6, 4, 128)
    sf64 = sf.double().unsqueeze(-1)
    err = (x64 - q.double().reshape(6, 4, 128) * sf64).abs()
    assert torch.all(err <= _error_bound(x64, sf64, dtype)), "dequantization error above half an fp8 ulp"
    # the largest element of every non-zero group saturates exactly to +-fmax (without ue8m0)
    if not ue8m0:
        qmax = q.float().reshape(6, 4, 128).abs().amax(-1)
        nonzero = torch.from_numpy(amax) > 1e-4
        assert torch.all(qmax[nonzero] == fmax)


@pytest.mark.parametrize("dtype", FP8)
def test_reference_zero_rows_and_saturation(dtype):
    x = torch.zeros(3, 256)
    x[1, 5] = 1e30
    x[2] = torch.linspace(-7, 7, 256)
    q, sf = fp8.quant_per_token_group(x, 128, dtype=dtype, backend="torch")
    floor = torch.tensor(1e-4, dtype=torch.float32) / torch.tensor(torch.finfo(dtype).max, dtype=torch.float32)
    assert torch.all(sf[0] == floor) and torch.all(q[0].float() == 0)
    assert sf[1, 1] == floor and q[1, 5].float() == torch.finfo(dtype).max
    assert q.float().abs().max() <= torch.finfo(dtype).max
    # a caller-side scale that is too small would overflow: the reference clamps before the cast
    q2 = reference.cast_scaled(torch.tensor([1e6, -1e6]), torch.tensor(1.0), dtype)
    assert q2.float().tolist() == [torch.finfo(dtype).max, -torch.finfo(dtype).max]


def test_reference_ue8m0_rounding_on_bits():
    sf = torch.tensor([1.0, 1.5, 2.0 ** -20, 3.0 * 2.0 ** -20, 0.75, 2.0 ** 100 * 1.0000001], dtype=torch.float32)
    want = torch.tensor([1.0, 2.0, 2.0 ** -20, 2.0 ** -18, 1.0, 2.0 ** 101], dtype=torch.float32)
    assert_bitwise_equal(reference.round_scale_ue8m0(sf), want, "ue8m0")


@pytest.mark.parametrize("dtype", FP8)
def test_reference_per_block_rowwise_tensorwise(dtype):
    w = make_input((2, 67, 131), torch.float32, seed=2)
    q, sf = fp8.quant_per_block(w, (32, 64), dtype=dtype, backend="torch")
    assert sf.shape == (2, 3, 3)
    for g, i, j in [(0, 0, 0), (1, 2, 2), (1, 0, 2)]:  # interior and ragged edge blocks
        block = w[g, i * 32:(i + 1) * 32, j * 64:(j + 1) * 64]
        want = reference.scale_from_amax(block.abs().amax(), dtype, False)
        assert_bitwise_equal(sf[g, i, j], want, f"block {g, i, j}")
    for q_, sf_, x_, gs in [
        (q, sf, w, (32, 64)),
        (*fp8.quant_rowwise(w, dtype=dtype, backend="torch"), w, (1, 131)),
        (*fp8.quant_tensorwise(w, dtype=dtype, backend="torch"), w, tuple(w.shape)),
    ]:
        x64 = x_.double()
        sf64 = reference.expand_scales(sf_, q_.shape, gs).double()
        assert torch.all((x64 - q_.double() * sf64).abs() <= _error_bound(x64, sf64, dtype)), f"group_shape {gs}"
        deq = fp8.dequant(q_, sf_, group_shape=gs, out_dtype=torch.float32)
        assert_bitwise_equal(deq, (q_.double() * sf64).float(), f"dequant {gs}")


def test_dequant_out_dtype_and_shapes():
    x = make_input((4, 256), torch.bfloat16, seed=3)
    q, sf = fp8.quant_per_token_group(x, 128, backend="torch")
    y = fp8.dequant(q, sf, group_shape=(1, 128))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert_bitwise_equal(y, (q.float() * sf.repeat_interleave(128, dim=1)).bfloat16(), "dequant")


# ---------------------------------------------------------------- Triton (interpreter) vs reference


@CPU_TRITON
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape,group", [((5, 256), 128), ((2, 3, 384), 128), ((1,), 1), ((4, 13), 13), ((3, 26), 2)])
def test_triton_per_token_group_bitwise(in_dtype, dtype, ue8m0, shape, group):
    x = make_input(shape, in_dtype, seed=zlib.crc32(repr((in_dtype, dtype, ue8m0, shape)).encode()))
    check_same(fp8.quant_per_token_group, x, group, dtype=dtype, ue8m0=ue8m0, backend="triton")


@CPU_TRITON
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize(
    "in_dtype,shape,block,ue8m0",
    [
        (torch.bfloat16, (130, 259), (128, 128), False),
        (torch.float32, (2, 67, 131), (32, 64), True),
        (torch.float16, (2, 67, 131), (32, 64), False),
        (torch.bfloat16, (1, 1), (128, 128), True),
        (torch.float32, (3, 5, 7), (2, 4), True),
    ],
)
def test_triton_per_block_bitwise(in_dtype, dtype, shape, block, ue8m0):
    w = make_input(shape, in_dtype, seed=len(shape) * 100 + block[0])
    check_same(fp8.quant_per_block, w, block, dtype=dtype, ue8m0=ue8m0, backend="triton")


@CPU_TRITON
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("shape", [(1,), (5, 13), (2, 3, 257)])
def test_triton_rowwise_bitwise(in_dtype, dtype, shape):
    check_same(fp8.quant_rowwise, make_input(shape, in_dtype, seed=7), dtype=dtype, backend="triton")


@CPU_TRITON
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("shape", [(), (1,), (97,), (33, 65)])
def test_triton_tensorwise_bitwise(in_dtype, dtype, shape):
    check_same(fp8.quant_tensorwise, make_input(shape, in_dtype, seed=11), dtype=dtype, backend="triton")


@CPU_TRITON
def test_triton_chunked_paths_bitwise(monkeypatch):
    """Shrink the tile so the GPU-sized code paths run on CPU: rows longer than a tile, blocks
    larger than a tile, and more tiles than partial maxima in the tensorwise reduction."""
    from primerl.kernels.fp8 import triton as fp8_triton

    monkeypatch.setattr(fp8_triton, "_INTERPRETER_TILE", 64)
    monkeypatch.setattr(fp8_triton, "_MAX_PARTIALS", 3)
    x = make_input((3, 300), torch.bfloat16, seed=5)
    check_same(fp8.quant_rowwise, x, backend="triton")
    check_same(fp8.quant_per_token_group, x, 150, ue8m0=True, backend="triton")
    w = make_input((12, 140), torch.float32, seed=6)
    check_same(fp8.quant_per_block, w, (5, 40), backend="triton")  # row chunks
    check_same(fp8.quant_per_block, w, (5, 100), ue8m0=True, backend="triton")  # row and column chunks
    check_same(fp8.quant_tensorwise, x, dtype=torch.float8_e5m2, backend="triton")


def _ties_input() -> torch.Tensor:
    """A 16-wide group with amax 448 (so sf = 1 exactly for e4m3) holding e4m3 rounding ties,
    subnormal ties and a carry into the next binade."""
    row = [448.0, 17.0, 19.0, -17.0, 2.0 ** -10, 3 * 2.0 ** -10, 31.0, 15.5, 0.0, -0.0, 1.0625, 1.1875, 240.0, 232.0, 2.0 ** -7 + 2.0 ** -10, 5.0]
    return torch.tensor([row, [v / 4 for v in row]], dtype=torch.float32)


@CPU_TRITON
def test_triton_rounding_ties_bitwise():
    x = _ties_input()
    q, sf = fp8.quant_per_token_group(x, 16, backend="torch")
    assert sf[0, 0] == 1.0 and q[0, 1].float() == 16.0 and q[0, 2].float() == 20.0  # ties to even
    check_same(fp8.quant_per_token_group, x, 16, backend="triton")
    check_same(fp8.quant_per_token_group, x, 16, dtype=torch.float8_e5m2, backend="triton")


@pytest.mark.no_poison
def test_triton_kernels_compile_for_hopper():
    """Compile every Triton kernel for sm_90 (no GPU needed) and read the PTX: the division must be
    IEEE (div.rn), never the approximate div.full/div.approx a plain `/` gives, and the fp8 cast
    the round-to-nearest-even satfinite conversion."""
    script = textwrap.dedent(
        """
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from primerl.kernels.fp8 import triton as T

        def ptx(fn, sig, consts):
            full = dict(sig, **{k: "constexpr" for k in consts})
            return triton.compile(ASTSource(fn, full, consts), target=GPUTarget("cuda", 90, 32)).asm["ptx"]

        rows = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "sf_ptr": "*fp32", "n_rows": "i32", "row_len": "i32"}
        blocks = {"w_ptr": "*fp16", "q_ptr": "*fp8e5", "sf_ptr": "*fp32", "N": "i32", "K": "i32", "bn": "i32",
                  "bk": "i32", "n_blocks_n": "i32", "n_blocks_k": "i32"}
        cast = {"x_ptr": "*fp32", "q_ptr": "*fp8e4nv", "partial_ptr": "*fp32", "sf_ptr": "*fp32", "numel": "i32",
                "n_partials": "i32"}
        out = {
            "rows": ptx(T._quant_rows_kernel, rows, dict(BLOCK_R=32, BLOCK_C=128, NUM_CHUNKS=1, FMAX=448.0, UE8M0=True)),
            "rows_chunked": ptx(T._quant_rows_kernel, rows, dict(BLOCK_R=1, BLOCK_C=1024, NUM_CHUNKS=3, FMAX=448.0, UE8M0=False)),
            "blocks": ptx(T._quant_blocks_kernel, blocks, dict(BLOCK_N=32, BLOCK_K=128, CHUNKS_N=4, CHUNKS_K=1, FMAX=57344.0, UE8M0=True)),
            "tensorwise": ptx(T._cast_tensorwise_kernel, cast, dict(BLOCK=4096, PARTIALS_BLOCK=1024, FMAX=448.0)),
        }
        for name, text in out.items():
            print(name, "div.rn.f32" in text, "div.full" in text or "div.approx" in text, "cvt.rn.satfinite.e" in text)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.split("\n")
    got = {line.split()[0]: line.split()[1:] for line in lines if line.strip()}
    assert set(got) == {"rows", "rows_chunked", "blocks", "tensorwise"}, res.stdout
    for name, (div_rn, approx, satfinite) in got.items():
        assert (div_rn, approx, satfinite) == ("True", "False", "True"), f"{name}: {res.stdout}"


# ---------------------------------------------------------------- CUDA sources, emulated on CPU

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cuda_include_dir():
    candidates = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for root in candidates:
        if root and os.path.exists(os.path.join(root, "include", "cuda_fp8.h")):
            return os.path.join(root, "include")
    return None


@pytest.fixture(scope="module")
def cuda_emulation(tmp_path_factory):
    """csrc/fp8/quant.cu compiled for the CPU by tests/kernels/fp8_cuda_emulation.cpp (ctypes)."""
    include = _cuda_include_dir()
    if include is None or shutil.which("g++") is None:
        pytest.skip("needs g++ and the CUDA headers (cuda_fp8.h)")
    lib = tmp_path_factory.mktemp("fp8_emulation") / "libfp8emu.so"
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-I{include}", f"-I{REPO}/csrc",
           os.path.join(REPO, "tests", "kernels", "fp8_cuda_emulation.cpp"), "-o", str(lib)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return ctypes.CDLL(str(lib))


_EMU_IN = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_EMU_OUT = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def _emu_rows(lib, x, row_len, dtype, ue8m0, sf_shape):
    q, sf = torch.empty(x.shape, dtype=dtype), torch.empty(sf_shape)
    rc = lib.emu_quant_rows(_ptr(x), _EMU_IN[x.dtype], _ptr(q), _EMU_OUT[dtype], _ptr(sf),
                            ctypes.c_long(x.numel() // row_len), ctypes.c_long(row_len), int(ue8m0))
    assert rc == 0
    return q, sf


@pytest.mark.parametrize(
    "in_dtype,dtype,ue8m0,shape,group,offset",
    [
        (torch.bfloat16, torch.float8_e4m3fn, False, (5, 256), 128, 0),  # 16-byte vectors, team of 8
        (torch.float32, torch.float8_e5m2, True, (3, 13), 13, 0),  # scalar path (13 % 4 != 0)
        (torch.float16, torch.float8_e4m3fn, True, (2, 2048), 2048, 0),  # team of 128: cross-warp reduction
        (torch.float32, torch.float8_e4m3fn, False, (1,), 1, 0),  # team of 1
        (torch.bfloat16, torch.float8_e5m2, False, (4, 128), 64, 1),  # misaligned input: scalar fallback
    ],
)
def test_cuda_source_rows_emulated_bitwise(cuda_emulation, in_dtype, dtype, ue8m0, shape, group, offset):
    base = make_input((shape[0] * shape[-1] + offset,), in_dtype, seed=31)
    x = base[offset:].reshape(shape)
    got = _emu_rows(cuda_emulation, x, group, dtype, ue8m0, (*shape[:-1], shape[-1] // group))
    want = fp8.quant_per_token_group(x, group, dtype=dtype, ue8m0=ue8m0, backend="torch")
    assert_bitwise_equal(got[1], want[1], "sf")
    assert_bitwise_equal(got[0], want[0], "q")


@pytest.mark.parametrize("dtype", FP8)
def test_cuda_source_rowwise_and_ties_emulated_bitwise(cuda_emulation, dtype):
    x = make_input((3, 1000), torch.float32, seed=32)
    got = _emu_rows(cuda_emulation, x, 1000, dtype, False, (3, 1))
    want = fp8.quant_rowwise(x, dtype=dtype, backend="torch")
    assert_bitwise_equal(got[1], want[1], "rowwise sf")
    assert_bitwise_equal(got[0], want[0], "rowwise q")
    x = _ties_input()
    got = _emu_rows(cuda_emulation, x, 16, dtype, False, (2, 1))
    want = fp8.quant_per_token_group(x, 16, dtype=dtype, backend="torch")
    assert_bitwise_equal(got[0], want[0], "ties q")


@pytest.mark.parametrize(
    "in_dtype,dtype,ue8m0,shape,block",
    [
        (torch.bfloat16, torch.float8_e4m3fn, True, (130, 259), (128, 128)),  # ragged edges, scalar path
        (torch.float32, torch.float8_e5m2, False, (2, 67, 136), (32, 64)),  # 3D, vectors, ragged rows
        (torch.float16, torch.float8_e4m3fn, False, (3, 300), (1, 100)),  # one-row blocks
    ],
)
def test_cuda_source_blocks_emulated_bitwise(cuda_emulation, in_dtype, dtype, ue8m0, shape, block):
    w = make_input(shape, in_dtype, seed=33)
    n, k = shape[-2:]
    nb, kb = -(-n // block[0]), -(-k // block[1])
    q, sf = torch.empty(shape, dtype=dtype), torch.empty(*shape[:-2], nb, kb)
    rc = cuda_emulation.emu_quant_blocks(_ptr(w), _EMU_IN[in_dtype], _ptr(q), _EMU_OUT[dtype], _ptr(sf),
                                         ctypes.c_long(w.numel() // (n * k)), ctypes.c_long(n), ctypes.c_long(k),
                                         ctypes.c_long(block[0]), ctypes.c_long(block[1]), int(ue8m0))
    assert rc == 0
    want = fp8.quant_per_block(w, block, dtype=dtype, ue8m0=ue8m0, backend="torch")
    assert_bitwise_equal(sf, want[1], "sf")
    assert_bitwise_equal(q, want[0], "q")


@pytest.mark.parametrize(
    "in_dtype,dtype,shape",
    [(torch.bfloat16, torch.float8_e4m3fn, (33, 64)), (torch.float32, torch.float8_e5m2, (97,)),
     (torch.float16, torch.float8_e4m3fn, ()), (torch.float32, torch.float8_e4m3fn, (20000,))],
)
def test_cuda_source_tensorwise_emulated_bitwise(cuda_emulation, in_dtype, dtype, shape):
    x = make_input(shape, in_dtype, seed=34)
    workspace = torch.empty(cuda_emulation.emu_quant_tensorwise_workspace(ctypes.c_long(x.numel())))
    q, sf = torch.empty(shape, dtype=dtype), torch.empty(())
    rc = cuda_emulation.emu_quant_tensorwise(_ptr(x), _EMU_IN[in_dtype], _ptr(q), _EMU_OUT[dtype], _ptr(sf),
                                             _ptr(workspace), ctypes.c_long(x.numel()))
    assert rc == 0
    want = fp8.quant_tensorwise(x, dtype=dtype, backend="torch")
    assert_bitwise_equal(sf, want[1], "sf")
    assert_bitwise_equal(q, want[0], "q")


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: fp8.quant_per_token_group(torch.randn(2, 100), 128), r"K=100 .*divisible by group_size=128"),
        (lambda: fp8.quant_per_token_group(torch.randn(2, 128), 0), r"group_size=0"),
        (lambda: fp8.quant_per_token_group(torch.randn(2, 128), dtype=torch.float16), r"dtype must be one of"),
        (lambda: fp8.quant_per_token_group(torch.randn(2, 128).double()), r"input dtype .* got torch.float64"),
        (lambda: fp8.quant_per_token_group(torch.ones(2, 128, dtype=torch.int32)), r"input dtype .* got torch.int32"),
        (lambda: fp8.quant_per_token_group(torch.randn(0, 128)), r"input is empty"),
        (lambda: fp8.quant_per_token_group(torch.tensor(1.0), 1), r"input must have 1..any dims"),
        (lambda: fp8.quant_per_block(torch.randn(128)), r"input must have 2..3 dims"),
        (lambda: fp8.quant_per_block(torch.randn(2, 2, 2, 2)), r"input must have 2..3 dims"),
        (lambda: fp8.quant_per_block(torch.randn(4, 4), (0, 128)), r"block_size must be two positive ints"),
        (lambda: fp8.quant_per_block(torch.randn(4, 0)), r"input is empty"),
        (lambda: fp8.quant_rowwise(torch.tensor(2.0)), r"input must have 1..any dims"),
        (lambda: fp8.quant_rowwise(torch.ones(3, dtype=torch.bool)), r"input dtype"),
        (lambda: fp8.quant_tensorwise(torch.randn(3), dtype=torch.int8), r"dtype must be one of"),
        (lambda: fp8.quant_tensorwise(torch.randn(3), backend="nope"), r"backend 'nope' is not implemented"),
        (lambda: fp8.dequant(torch.randn(2, 128), torch.ones(2, 1), group_shape=(1, 128)), r"q must be fp8"),
        (lambda: fp8.dequant(torch.zeros(2, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 1).half(), group_shape=(1, 128)),
         r"sf must be float32"),
        (lambda: fp8.dequant(torch.zeros(2, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 3), group_shape=(1, 64)),
         r"sf has 3 groups on dim 1, expected ceil\(128/64\) = 2"),
    ],
)
def test_validation_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_non_tensor_input_is_a_type_error():
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        fp8.quant_rowwise([1.0, 2.0])


@pytest.mark.skipif(HAS_CUDA_EXT and torch.cuda.is_available(), reason="the cuda backend is available here")
def test_cuda_backend_unavailable_is_explicit():
    with pytest.raises(BackendUnavailableError, match="cuda"):
        fp8.quant_per_token_group(torch.randn(2, 128), backend="cuda")


# ---------------------------------------------------------------- GPU: CUDA and Triton vs reference

GPU_BACKENDS = [
    "triton",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA_EXT, reason="primerl._C not built")),
]
BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


def _gpu_cases(small, large):
    """Every input/fp8 dtype pair on the small cases; the large (real-size) cases in bf16 -> e4m3."""
    cases = [(i, o, *c) for c in small for i in IN_DTYPES for o in FP8]
    return cases + [(BF16, E4M3, *c) for c in large]


def _gpu_check(op, x, *args, backend, **kwargs):
    """Kernel on the GPU against the reference computed on CPU (the spec) and on the GPU."""
    q_cpu, sf_cpu = op(x.cpu(), *args, backend="torch", **kwargs)
    q_ref, sf_ref = op(x, *args, backend="torch", **kwargs)
    q, sf = op(x, *args, backend=backend, **kwargs)
    torch.cuda.synchronize()
    assert_bitwise_equal(sf_ref.cpu(), sf_cpu, "reference sf on GPU vs CPU")
    assert_bitwise_equal(q_ref.cpu(), q_cpu, "reference q on GPU vs CPU")
    assert_bitwise_equal(sf.cpu(), sf_cpu, f"{backend} sf")
    assert_bitwise_equal(q.cpu(), q_cpu, f"{backend} q")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(
    "in_dtype,dtype,ue8m0,shape,group",
    _gpu_cases(
        small=[(False, (1,), 1), (True, (4, 13), 13), (False, (3, 5, 256), 128), (True, (64, 4096), 64)],
        large=[(False, (4096, 7168), 128), (True, (515, 7168), 128)],
    ),
)
def test_gpu_per_token_group_bitwise(backend, in_dtype, dtype, ue8m0, shape, group):
    x = make_input(shape, in_dtype, seed=21).cuda()
    _gpu_check(fp8.quant_per_token_group, x, group, dtype=dtype, ue8m0=ue8m0, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(
    "in_dtype,dtype,shape,block,ue8m0",
    _gpu_cases(
        small=[((1, 1), (128, 128), False), ((130, 259), (128, 128), True), ((2, 67, 131), (32, 64), True),
               ((5, 300), (1, 100), False)],
        large=[((7168, 7168), (128, 128), False), ((3, 517, 1031), (128, 128), True)],
    ),
)
def test_gpu_per_block_bitwise(backend, in_dtype, dtype, shape, block, ue8m0):
    w = make_input(shape, in_dtype, seed=22).cuda()
    _gpu_check(fp8.quant_per_block, w, block, dtype=dtype, ue8m0=ue8m0, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(
    "in_dtype,dtype,shape",
    _gpu_cases(small=[((1,),), ((5, 13),), ((2, 3, 257),)], large=[((4096, 7168),), ((3, 70001),)]),
)
def test_gpu_rowwise_bitwise(backend, in_dtype, dtype, shape):
    _gpu_check(fp8.quant_rowwise, make_input(shape, in_dtype, seed=23).cuda(), dtype=dtype, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(
    "in_dtype,dtype,shape",
    _gpu_cases(small=[((),), ((1,),), ((97,),), ((33, 65),)], large=[((4096, 7168),), ((12345679,),)]),
)
def test_gpu_tensorwise_bitwise(backend, in_dtype, dtype, shape):
    _gpu_check(fp8.quant_tensorwise, make_input(shape, in_dtype, seed=24).cuda(), dtype=dtype, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", FP8)
def test_gpu_rounding_ties_bitwise(backend, dtype):
    _gpu_check(fp8.quant_per_token_group, _ties_input().cuda(), 16, dtype=dtype, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_non_contiguous_and_offset_inputs(backend):
    base = make_input((9, 1030), torch.bfloat16, seed=25).cuda()
    x = base[1:, 3:1027]  # misaligned, non-contiguous: the wrapper makes it contiguous
    _gpu_check(fp8.quant_per_token_group, x, 128, backend=backend)
    y = base.reshape(-1)[1:1 + 8 * 1024].reshape(8, 1024)  # contiguous but not 16-byte aligned
    _gpu_check(fp8.quant_rowwise, y, backend=backend)
    _gpu_check(fp8.quant_tensorwise, y, backend=backend)
    _gpu_check(fp8.quant_per_block, y, (128, 128), backend=backend)


@pytest.mark.gpu
def test_gpu_triton_chunked_paths_bitwise(monkeypatch):
    """The multi-chunk code paths (long rows, large blocks, strided partial maxima) on the GPU."""
    from primerl.kernels.fp8 import triton as fp8_triton

    monkeypatch.setattr(fp8_triton, "_GPU_TILE", 64)
    monkeypatch.setattr(fp8_triton, "_GPU_BLOCK_TILE", 64)
    monkeypatch.setattr(fp8_triton, "_MAX_PARTIALS", 3)
    x = make_input((6, 300), torch.bfloat16, seed=26).cuda()
    _gpu_check(fp8.quant_rowwise, x, backend="triton")
    _gpu_check(fp8.quant_per_token_group, x, 150, ue8m0=True, backend="triton")
    _gpu_check(fp8.quant_tensorwise, x, dtype=torch.float8_e5m2, backend="triton")
    w = make_input((2, 45, 270), torch.float32, seed=27).cuda()
    _gpu_check(fp8.quant_per_block, w, (20, 33), backend="triton")
    _gpu_check(fp8.quant_per_block, w, (5, 100), ue8m0=True, backend="triton")
