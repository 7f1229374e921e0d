"""Each correction in primerl.kernels._triton_interpreter is needed and works.

Every test runs a tiny @triton.jit kernel twice: with the corrections (the result must match torch,
i.e. what a GPU computes) and with them removed (the result must be wrong: otherwise the correction
and this test prove nothing). The corrections are always re-applied, even when an assertion fails.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from primerl.kernels import _triton_interpreter, triton_interpreter_enabled

pytestmark = pytest.mark.skipif(not triton_interpreter_enabled(), reason="only meaningful under TRITON_INTERPRET=1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@contextlib.contextmanager
def corrections_removed():
    was_applied = _triton_interpreter.is_applied()
    _triton_interpreter.remove()
    try:
        yield
    finally:
        if was_applied:
            _triton_interpreter.apply()
        assert _triton_interpreter.is_applied() == was_applied


@pytest.fixture(autouse=True)
def corrections_active():
    assert _triton_interpreter.is_applied(), "primerl.kernels should apply the corrections on import"
    yield
    assert _triton_interpreter.is_applied(), "a test left the corrections removed"


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m = tl.arange(0, M)
    n = tl.arange(0, N)
    k = tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(c_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, x.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scalar_cast_kernel(x_ptr, y_ptr):
    tl.store(y_ptr, tl.load(x_ptr).to(y_ptr.dtype.element_ty))


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32)
    _dot_kernel[(1,)](a, b, c, M=a.shape[0], N=b.shape[1], K=a.shape[1])
    return c


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=dtype)
    _cast_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return y


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def test_bf16_dot():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=g).bfloat16()
    b = torch.randn(32, 16, generator=g).bfloat16()
    want = a.float() @ b.float()
    torch.testing.assert_close(_dot(a, b), want, rtol=1e-5, atol=1e-5)
    with corrections_removed():
        wrong = _dot(a, b)
    assert (wrong - want).abs().max() > 1e3, "the uncorrected interpreter multiplied bf16 correctly?"


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp32_to_fp8_cast_rounds_and_saturates(dtype):
    fmax = torch.finfo(dtype).max
    g = torch.Generator().manual_seed(1)
    # 31.13 must carry into the next binade (32), 500 / 1e5 must saturate to the largest finite value
    special = torch.tensor([31.13, 500.0, -500.0, 1e5, -1e5, 0.0, -0.0, 1e-3, 2.0 ** -10])
    x = torch.cat([special, torch.randn(1000, generator=g) * 50])
    want = x.clamp(-fmax, fmax).to(dtype)  # what the GPU's cvt.rn.satfinite gives
    got = _cast(x, dtype)
    assert torch.equal(_bits(got), _bits(want))
    assert got[0].float() == 32.0 and got[1].float() == min(512.0, fmax) and got[3].float() == fmax
    with corrections_removed():
        wrong = _cast(x, dtype)
    assert not torch.equal(_bits(wrong), _bits(want))
    assert wrong[0].float() != 32.0, "uncorrected 31.13 was expected to lose its rounding carry"
    assert (_bits(wrong) != _bits(want)).float().mean() > 0.005


def test_fp32_to_bf16_cast_rounds_to_nearest_even():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1024, generator=g)
    want = x.bfloat16()
    assert torch.equal(_bits(_cast(x, torch.bfloat16)), _bits(want))
    with corrections_removed():
        wrong = _cast(x, torch.bfloat16)
    # truncation instead of rounding: about half the values come out one ulp towards zero
    assert (_bits(wrong) != _bits(want)).float().mean() > 0.2


def test_scalar_cast_keeps_its_shape():
    x = torch.tensor([31.13])
    y = torch.empty(1, dtype=torch.float8_e4m3fn)
    _scalar_cast_kernel[(1,)](x, y)
    assert y.float().item() == 32.0
    with corrections_removed():
        _scalar_cast_kernel[(1,)](x, y)
    assert y.float().item() != 32.0


def test_apply_and_remove_are_idempotent():
    with corrections_removed():
        _triton_interpreter.remove()  # a second remove is a no-op
        assert not _triton_interpreter.is_applied()
    assert _triton_interpreter.apply() is True
    assert _triton_interpreter.apply() is True  # a second apply does not wrap the hooks again
    from triton.runtime import interpreter

    assert interpreter.InterpreterBuilder.create_dot is not _triton_interpreter.ORIGINALS["create_dot"]
    x = torch.tensor([31.13, 500.0])
    assert _cast(x, torch.float8_e4m3fn).float().tolist() == [32.0, 448.0]


@triton.jit
def _rtz_cast_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16, fp_downcast_rounding="rtz"))


def test_explicit_rtz_downcast_is_left_alone():
    """The bf16 correction applies to the default (round-to-nearest-even) cast only."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(3))
    y = torch.empty(256, dtype=torch.bfloat16)
    _rtz_cast_kernel[(1,)](x, y, BLOCK=256)
    truncated = (x.view(torch.int32) >> 16).to(torch.int16)
    assert torch.equal(y.view(torch.int16), truncated)
