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
    row = [448.0, 17.0, 19.0, -17.0, 2.0 ** -10, 3 * 2.0 ** -10, 31.0, 15.5, 0.0, -0.0, 1.0625, 1.1875, 240.0, 232.0,
           2.0 ** -7 + 2.0 ** -10, 5.0]
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
    IEEE (div.rn, also for the reciprocal), never the approximate div.full/div.approx/rcp.approx a
    plain `/` gives, and the fp8 cast
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
        cast = {"x_ptr": "*fp32", "q_ptr": "*fp8e4nv", "partial_ptr": "*i32", "sf_ptr": "*fp32", "numel": "i32",
                "n_partials": "i32"}
        out = {
            "rows": ptx(T._quant_rows_kernel, rows, dict(BLOCK_R=32, BLOCK_C=128, NUM_CHUNKS=1, FMAX=448.0, UE8M0=True,
                                                         RECIPROCAL=True)),
            "rows_chunked": ptx(T._quant_rows_kernel, rows, dict(BLOCK_R=1, BLOCK_C=1024, NUM_CHUNKS=3, FMAX=448.0,
                                                                 UE8M0=False, RECIPROCAL=False)),
            "blocks": ptx(T._quant_blocks_kernel, blocks, dict(BLOCK_N=32, BLOCK_K=128, CHUNKS_N=4, CHUNKS_K=1,
                                                               FMAX=57344.0, UE8M0=True, RECIPROCAL=True)),
            "tensorwise": ptx(T._cast_tensorwise_kernel, cast, dict(BLOCK=4096, PARTIALS_BLOCK=1024, FMAX=448.0,
                                                                    RECIPROCAL=False)),
        }
        for name, text in out.items():
            approx = any(op in text for op in ("div.full", "div.approx", "rcp.approx"))
            print(name, "div.rn.f32" in text, approx, "cvt.rn.satfinite.e" in text)
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


def _emu_rows(lib, x, row_len, dtype, ue8m0, sf_shape, rounding="divide"):
    q, sf = torch.empty(x.shape, dtype=dtype), torch.empty(sf_shape)
    rc = lib.emu_quant_rows(_ptr(x), _EMU_IN[x.dtype], _ptr(q), _EMU_OUT[dtype], _ptr(sf),
                            ctypes.c_long(x.numel() // row_len), ctypes.c_long(row_len), int(ue8m0),
                            int(rounding == "reciprocal"))
    assert rc == 0
    return q, sf


def _emu_blocks(lib, w, block, dtype, ue8m0, rounding):
    n, k = w.shape[-2:]
    nb, kb = -(-n // block[0]), -(-k // block[1])
    q, sf = torch.empty(w.shape, dtype=dtype), torch.empty(*w.shape[:-2], nb, kb)
    rc = lib.emu_quant_blocks(_ptr(w), _EMU_IN[w.dtype], _ptr(q), _EMU_OUT[dtype], _ptr(sf),
                              ctypes.c_long(w.numel() // (n * k)), ctypes.c_long(n), ctypes.c_long(k),
                              ctypes.c_long(block[0]), ctypes.c_long(block[1]), int(ue8m0),
                              int(rounding == "reciprocal"))
    assert rc == 0
    return q, sf


def _emu_tensorwise(lib, x, dtype, rounding):
    workspace = torch.empty(lib.emu_quant_tensorwise_workspace(ctypes.c_long(x.numel())))
    q, sf = torch.empty(x.shape, dtype=dtype), torch.empty(())
    rc = lib.emu_quant_tensorwise(_ptr(x), _EMU_IN[x.dtype], _ptr(q), _EMU_OUT[dtype], _ptr(sf), _ptr(workspace),
                                  ctypes.c_long(x.numel()), int(rounding == "reciprocal"))
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
    got = _emu_rows(cuda_emulation, x, group, dtype, ue8m0, (*shape[:-1], shape[-1] // group), "reciprocal")
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
    q, sf = _emu_blocks(cuda_emulation, w, block, dtype, ue8m0, "reciprocal")
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
    q, sf = _emu_tensorwise(cuda_emulation, x, dtype, "divide")
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
        (lambda: fp8.dequant(torch.zeros(2, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 1).half(),
                             group_shape=(1, 128)),
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


# ---------------------------------------------------------------- rounding modes and the NaN / inf policy

ROUNDING = ["reciprocal", "divide"]


def rounding_sensitive_groups(n_groups: int, size: int, in_dtype, dtype, seed: int) -> torch.Tensor:
    """[n_groups, size] values where ``x / sf`` and ``x * (1 / sf)`` round to different fp8 bytes
    (quotients within a few ulps of an fp8 rounding midpoint), each group led by its own amax."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[grid.isfinite() & (grid > 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    ibits = torch.int32 if in_dtype == torch.float32 else torch.int16
    rows = []
    while len(rows) < n_groups:  # some scales separate the modes far more often than others: retry
        amax = (torch.rand(1, generator=g) * 10 + 0.5).to(in_dtype).float()
        sf = reference.scale_from_amax(amax, dtype, False)
        x = (mids[torch.randint(len(mids), (8 * size,), generator=g)] * sf).to(in_dtype)
        x = (x.view(ibits) + torch.randint(-3, 4, x.shape, generator=g).to(ibits)).view(in_dtype).float()
        x = x[(x.abs() < amax) & x.isfinite()]
        differs = reference.cast_scaled(x, sf, dtype, "divide").view(torch.uint8) != \
            reference.cast_scaled(x, sf, dtype, "reciprocal").view(torch.uint8)
        if int(differs.sum()) < 2:
            continue
        row = torch.cat([amax, x[differs], x[~differs]])[:size]
        rows.append(row * torch.where(torch.rand(size, generator=g) < 0.5, -1.0, 1.0))
    return torch.stack(rows).to(in_dtype)


def _blocks_to_weight(groups: torch.Tensor, nb: int, kb: int, bn: int, bk: int) -> torch.Tensor:
    return groups.reshape(nb, kb, bn, bk).permute(0, 2, 1, 3).reshape(nb * bn, kb * bk)


def _sensitive(op: str, in_dtype, dtype, seed: int = 0):
    """(input, call(x, backend, rounding)) for every quantizer, laid out so that each scale group
    is one rounding-sensitive group."""
    from primerl.kernels import gemm

    if op == "per_token_group":
        x = rounding_sensitive_groups(6, 128, in_dtype, dtype, seed).reshape(3, 256)
        return x, lambda x, be, r: fp8.quant_per_token_group(x, 128, dtype=dtype, rounding=r, backend=be)
    if op == "per_block":
        x = _blocks_to_weight(rounding_sensitive_groups(4, 128, in_dtype, dtype, seed), 2, 2, 4, 32)
        return x, lambda x, be, r: fp8.quant_per_block(x, (4, 32), dtype=dtype, rounding=r, backend=be)
    if op == "rowwise":
        x = rounding_sensitive_groups(3, 200, in_dtype, dtype, seed)
        return x, lambda x, be, r: fp8.quant_rowwise(x, dtype=dtype, rounding=r, backend=be)
    if op == "tensorwise":
        x = rounding_sensitive_groups(1, 300, in_dtype, dtype, seed).reshape(20, 15)
        return x, lambda x, be, r: fp8.quant_tensorwise(x, dtype=dtype, rounding=r, backend=be)
    assert op == "per_group_colwise"  # two groups along T: 128 + 40 rows (column scales per block)
    x = torch.cat([rounding_sensitive_groups(16, 128, in_dtype, dtype, seed).t(),
                   rounding_sensitive_groups(16, 40, in_dtype, dtype, seed + 1).t()])
    offs = torch.tensor([128, 168], dtype=torch.int32)
    return x, lambda x, be, r: gemm.quant_per_group_colwise(x, offs, dtype=dtype, rounding=r, backend=be)


QUANT_OPS = ["per_token_group", "per_block", "rowwise", "tensorwise", "per_group_colwise"]


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", FP8)
def test_reference_rounding_modes_are_the_named_formulas(in_dtype, dtype):
    """reciprocal = DeepGEMM's per_token_cast_to_fp8 / per_block_cast_to_fp8 formula on CPU
    (``(x * (1.0 / sf)).to(fp8)``, sf = amax.clamp(1e-4) / fmax), divide = ``(x / sf)``; the inputs
    are chosen so the two differ, and ue8m0 scales (powers of two) make them equal."""
    x = rounding_sensitive_groups(4, 128, in_dtype, dtype, seed=1).reshape(2, 256)
    fmax = float(torch.finfo(dtype).max)
    groups = x.reshape(2, 2, 128)
    sf = groups.abs().float().amax(dim=2).clamp(1e-4) / fmax
    want = {"reciprocal": (groups * (1.0 / sf.unsqueeze(2))).to(dtype).reshape(2, 256),
            "divide": (groups.float() / sf.unsqueeze(2)).to(dtype).reshape(2, 256)}
    got = {r: fp8.quant_per_token_group(x, 128, dtype=dtype, rounding=r, backend="torch") for r in ROUNDING}
    for r in ROUNDING:
        assert_bitwise_equal(got[r][1], sf, f"{r} sf")
        assert_bitwise_equal(got[r][0], want[r], f"{r} q")
    assert not torch.equal(got["reciprocal"][0].view(torch.uint8), got["divide"][0].view(torch.uint8))
    assert_bitwise_equal(fp8.quant_per_token_group(x, 128, dtype=dtype, backend="torch")[0], want["reciprocal"],
                         "default")
    ue = [fp8.quant_per_token_group(x, 128, dtype=dtype, ue8m0=True, rounding=r, backend="torch") for r in ROUNDING]
    assert_bitwise_equal(ue[0][0], ue[1][0], "ue8m0 q, reciprocal vs divide")
    # per block: DeepGEMM's block formula on 4 x 32 blocks
    w = _blocks_to_weight(rounding_sensitive_groups(4, 128, in_dtype, dtype, seed=2), 2, 2, 4, 32)
    view = w.reshape(2, 4, 2, 32)
    bsf = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4) / fmax
    q, s = fp8.quant_per_block(w, (4, 32), dtype=dtype, backend="torch")
    assert_bitwise_equal(q, (view * (1.0 / bsf)).to(dtype).reshape(8, 64), "per block q")
    assert_bitwise_equal(s, bsf.reshape(2, 2), "per block sf")


def test_rounding_defaults_and_validation():
    import inspect

    from primerl.kernels import gemm

    defaults = {f.__name__: inspect.signature(f).parameters["rounding"].default
                for f in (fp8.quant_per_token_group, fp8.quant_per_block, fp8.quant_rowwise, fp8.quant_tensorwise,
                          gemm.quant_per_group_colwise)}
    assert defaults == {"quant_per_token_group": "reciprocal", "quant_per_block": "reciprocal",
                        "quant_rowwise": "divide", "quant_tensorwise": "divide",
                        "quant_per_group_colwise": "reciprocal"}
    with pytest.raises(ValueError, match=r"rounding must be one of \('reciprocal', 'divide'\), got 'mul'"):
        fp8.quant_per_token_group(torch.randn(2, 128), rounding="mul")
    with pytest.raises(ValueError, match="rounding must be one of"):
        gemm.quant_per_group_colwise(torch.randn(4, 8), torch.tensor([4], dtype=torch.int32), rounding="div")


@CPU_TRITON
@pytest.mark.parametrize("op", QUANT_OPS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rounding", ROUNDING)
def test_triton_rounding_bitwise(op, in_dtype, rounding):
    dtype = torch.float8_e4m3fn if in_dtype == torch.float32 else torch.float8_e5m2
    x, call = _sensitive(op, in_dtype, dtype)
    q_ref, sf_ref = call(x, "torch", rounding)
    other = call(x, "torch", "divide" if rounding == "reciprocal" else "reciprocal")[0]
    assert not torch.equal(q_ref.view(torch.uint8), other.view(torch.uint8)), "input does not separate the modes"
    q, sf = call(x, "triton", rounding)
    assert_bitwise_equal(sf, sf_ref, f"{op} sf")
    assert_bitwise_equal(q, q_ref, f"{op} q")


@pytest.mark.parametrize("op", ["per_token_group", "per_block", "rowwise", "tensorwise"])
@pytest.mark.parametrize("rounding", ROUNDING)
def test_cuda_source_rounding_emulated_bitwise(cuda_emulation, op, rounding):
    dtype = torch.float8_e4m3fn
    x, call = _sensitive(op, torch.bfloat16, dtype, seed=3)
    q_ref, sf_ref = call(x, "torch", rounding)
    assert not torch.equal(q_ref.view(torch.uint8), call(x, "torch", "divide" if rounding == "reciprocal"
                                                         else "reciprocal")[0].view(torch.uint8))
    if op == "per_token_group":
        q, sf = _emu_rows(cuda_emulation, x, 128, dtype, False, sf_ref.shape, rounding)
    elif op == "rowwise":
        q, sf = _emu_rows(cuda_emulation, x, x.shape[-1], dtype, False, sf_ref.shape, rounding)
    elif op == "per_block":
        q, sf = _emu_blocks(cuda_emulation, x, (4, 32), dtype, False, rounding)
    else:
        q, sf = _emu_tensorwise(cuda_emulation, x, dtype, rounding)
    assert_bitwise_equal(sf, sf_ref, f"{op} sf")
    assert_bitwise_equal(q, q_ref, f"{op} q")


NAN, INF = float("nan"), float("inf")


def _special_groups(in_dtype) -> torch.Tensor:
    """Four 32-wide groups: one NaN, one +inf (and a -inf), both, and a finite control group."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 32, generator=g) * 3
    x[0, 7] = NAN
    x[1, 3], x[1, 9] = INF, -INF
    x[2, 0], x[2, 31] = INF, NAN
    return x.to(in_dtype)


def assert_same_with_nan(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Bitwise equal except that NaN must meet NaN (the sign / payload of a NaN is not specified)."""
    a_nan, e_nan = actual.float().isnan(), expected.float().isnan()
    assert torch.equal(a_nan, e_nan), \
        f"{name}: NaN positions differ: {a_nan.nonzero().tolist()} vs {e_nan.nonzero().tolist()}"
    if actual.element_size() == 1:  # fp8: compare the bytes
        actual, expected = actual.view(torch.uint8), expected.view(torch.uint8)
    a, e = actual.clone(), expected.clone()
    a[a_nan], e[e_nan] = 0, 0
    assert_bitwise_equal(a, e, name)


@pytest.mark.parametrize("dtype", FP8)
def test_reference_nan_inf_policy(dtype):
    x = _special_groups(torch.float32)
    fmax = float(torch.finfo(dtype).max)
    q, sf = fp8.quant_per_token_group(x, 32, dtype=dtype, backend="torch")
    assert sf[:3].flatten().isnan().tolist() == [True, False, True] and sf[1] == INF and sf[3].isfinite()
    qf = q.float()
    assert qf[0].isnan().all() and qf[2].isnan().all()  # NaN group: every q NaN
    assert qf[1, 3].isnan() and qf[1, 9].isnan() and bool((qf[1].nan_to_num(0) == 0).all())  # inf / inf
    qu, su = fp8.quant_per_token_group(x, 32, dtype=dtype, ue8m0=True, backend="torch")
    two127 = torch.tensor(2.0 ** 127)
    assert_bitwise_equal(su[:3, 0], two127.expand(3).contiguous(), "ue8m0 sf of NaN / inf groups")
    # DeepGEMM's ceil_to_ue8m0 formula gives the same clamped exponent for inf and NaN
    bits = torch.tensor([INF, NAN, 3e38, 1e-45, 0.0]).view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
    assert_bitwise_equal(reference.round_scale_ue8m0(torch.tensor([INF, NAN, 3e38, 1e-45, 0.0])),
                         (exp.clamp(1, 254) << 23).view(torch.float32), "ue8m0 vs DeepGEMM's formula")
    quf = qu.float()
    assert quf[0].isnan().tolist() == (x[0].isnan()).tolist()  # ue8m0: NaN only where x is NaN
    assert quf[1, 3] == fmax and quf[1, 9] == -fmax  # inf saturates
    assert quf[2, 0] == fmax and quf[2, 31].isnan()


@CPU_TRITON
@pytest.mark.parametrize("op", QUANT_OPS)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_triton_nan_inf_policy(op, ue8m0):
    """The Triton kernels follow the reference's NaN / inf policy (a max that drops NaN would not)."""
    from primerl.kernels import gemm

    x = _special_groups(torch.bfloat16)
    calls = {
        "per_token_group": lambda be: fp8.quant_per_token_group(x, 32, ue8m0=ue8m0, backend=be),
        "per_block": lambda be: fp8.quant_per_block(x, (2, 16), ue8m0=ue8m0, backend=be),
        "rowwise": lambda be: fp8.quant_rowwise(x, backend=be),
        "tensorwise": lambda be: fp8.quant_tensorwise(x[1:], backend=be),
        "per_group_colwise": lambda be: gemm.quant_per_group_colwise(x.t().contiguous(),
                                                                     torch.tensor([20, 32], dtype=torch.int32),
                                                                     ue8m0=ue8m0, backend=be),
    }
    q_ref, sf_ref = calls[op]("torch")
    assert sf_ref.isnan().any() or ue8m0 or op == "tensorwise"
    q, sf = calls[op]("triton")
    assert_same_with_nan(sf, sf_ref, f"{op} sf")
    assert_same_with_nan(q, q_ref, f"{op} q")


@pytest.mark.parametrize("ue8m0", [False, True])
def test_cuda_source_nan_inf_policy_emulated(cuda_emulation, ue8m0):
    x = _special_groups(torch.float32)
    dtype = torch.float8_e4m3fn
    q_ref, sf_ref = fp8.quant_per_token_group(x, 32, ue8m0=ue8m0, backend="torch")
    q, sf = _emu_rows(cuda_emulation, x, 32, dtype, ue8m0, sf_ref.shape, "reciprocal")
    assert_same_with_nan(sf, sf_ref, "rows sf")
    assert_same_with_nan(q, q_ref, "rows q")
    q_ref, sf_ref = fp8.quant_per_block(x, (2, 16), ue8m0=ue8m0, backend="torch")
    q, sf = _emu_blocks(cuda_emulation, x, (2, 16), dtype, ue8m0, "reciprocal")
    assert_same_with_nan(sf, sf_ref, "blocks sf")
    assert_same_with_nan(q, q_ref, "blocks q")
    for part in (x, x[1:]):  # with and without a NaN
        q_ref, sf_ref = fp8.quant_tensorwise(part.contiguous(), backend="torch")
        q, sf = _emu_tensorwise(cuda_emulation, part.contiguous(), dtype, "divide")
        assert_same_with_nan(sf, sf_ref, "tensorwise sf")
        assert_same_with_nan(q, q_ref, "tensorwise q")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("op", ["per_token_group", "per_block", "rowwise", "tensorwise"])
@pytest.mark.parametrize("rounding", ROUNDING)
def test_gpu_rounding_and_nan_policy(backend, op, rounding):
    """On the GPU the compiled kernels (IEEE reciprocal / quotient, NaN-propagating maxima) match
    the CPU reference bitwise on rounding-sensitive inputs, and its NaN / inf policy."""
    x, call = _sensitive(op, torch.bfloat16, torch.float8_e4m3fn, seed=4)
    q_cpu, sf_cpu = call(x, "torch", rounding)
    q, sf = call(x.cuda(), backend, rounding)
    assert_bitwise_equal(sf.cpu(), sf_cpu, f"{op} sf")
    assert_bitwise_equal(q.cpu(), q_cpu, f"{op} q")
    special = _special_groups(torch.float32)
    calls = {"per_token_group": lambda t, be: fp8.quant_per_token_group(t, 32, ue8m0=True, rounding=rounding,
                                                                        backend=be),
             "per_block": lambda t, be: fp8.quant_per_block(t, (2, 16), rounding=rounding, backend=be),
             "rowwise": lambda t, be: fp8.quant_rowwise(t, rounding=rounding, backend=be),
             "tensorwise": lambda t, be: fp8.quant_tensorwise(t, rounding=rounding, backend=be)}
    q_ref, sf_ref = calls[op](special, "torch")
    q, sf = calls[op](special.cuda(), backend)
    assert_same_with_nan(sf.cpu(), sf_ref, f"{op} NaN/inf sf")
    assert_same_with_nan(q.cpu(), q_ref, f"{op} NaN/inf q")
