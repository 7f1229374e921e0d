"""Corrections to Triton's CPU interpreter (TRITON_INTERPRET=1), applied on import of primerl.kernels.

The interpreter silently computes some things differently from a GPU (measured on triton 3.7.1
and 3.9.0, see shared/NOTES.md):

* ``tl.dot`` on bf16 operands multiplies the raw 16-bit patterns (bf16 is stored as uint16);
* fp32/fp16/bf16 -> fp8 casts drop the rounding carry and do not saturate, while the GPU uses
  ``cvt.rn.satfinite`` (round to nearest even, clamp to the largest finite value);
* fp32 -> bf16 casts truncate, while the GPU rounds to nearest even.

Each hook below redoes the math through torch in float32 (as a GPU does), so a Triton kernel gives
the same bits on CPU as on a GPU. ``apply()`` is idempotent and a no-op when Triton is absent or
the interpreter is off. ``tests/kernels/test_triton_interpreter.py`` proves each correction.
"""

from __future__ import annotations

import numpy as np
import torch

_APPLIED = False
ORIGINALS: dict[str, object] = {}


def _torch_dtype(tl_dtype):
    import triton.language as tl

    table = {
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
        tl.bfloat16: torch.bfloat16,
        tl.float16: torch.float16,
        tl.float32: torch.float32,
        tl.float64: torch.float64,
    }
    return table.get(tl_dtype)


def _to_torch(data: np.ndarray, tl_dtype) -> torch.Tensor:
    """View the interpreter's numpy storage (fp8 as uint8, bf16 as uint16) as a torch tensor."""
    tdtype = _torch_dtype(tl_dtype)
    arr = np.ascontiguousarray(data)
    if tdtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.from_numpy(arr.view(np.uint8)).view(tdtype)
    if tdtype is torch.bfloat16:
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _from_torch(t: torch.Tensor) -> np.ndarray:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy()
    if t.dtype is torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()


def _convert(src_data: np.ndarray, src_tl, dst_tl) -> np.ndarray:
    """Float conversion as the GPU does it: RTNE, and satfinite for fp8 destinations."""
    dst = _torch_dtype(dst_tl)
    shape = np.shape(src_data)  # np.ascontiguousarray turns 0-d data into 1-d: restore the shape
    x = _to_torch(src_data, src_tl)
    if dst in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmax = torch.finfo(dst).max
        x32 = x.float()
        x32 = torch.where(torch.isnan(x32), x32, x32.clamp(-fmax, fmax))
        return _from_torch(x32.to(dst)).reshape(shape)
    return _from_torch(x.to(dst)).reshape(shape)


def _handled(tl_dtype) -> bool:
    return _torch_dtype(tl_dtype) is not None


def apply() -> bool:
    """Install the corrections into triton's interpreter. Returns True when they are active."""
    global _APPLIED
    if _APPLIED:
        return True
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    builder_cls = interp.InterpreterBuilder
    TensorHandle = interp.TensorHandle
    ORIGINALS.update(
        create_dot=builder_cls.create_dot,
        create_fp_to_fp=builder_cls.create_fp_to_fp,
        cast_impl=builder_cls.cast_impl,
    )
    orig_cast = builder_cls.cast_impl
    orig_fp_to_fp = builder_cls.create_fp_to_fp

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_t = _to_torch(a.data, a.dtype.scalar).float()
        b_t = _to_torch(b.data, b.dtype.scalar).float()
        acc_t = torch.from_numpy(np.ascontiguousarray(d.data))
        if acc_t.dtype.is_floating_point:
            out = (torch.matmul(a_t, b_t).to(acc_t.dtype) + acc_t).numpy()
        else:  # integer dots are exact in numpy already
            return ORIGINALS["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)
        return TensorHandle(out, d.dtype.scalar)

    def float_cast(self, src, dst_type, fallback, *args):
        s, t = src.dtype.scalar, dst_type.scalar
        if s.is_floating() and t.is_floating() and _handled(s) and _handled(t) and s != t:
            return TensorHandle(_convert(src.data, s, t), t)
        return fallback(self, src, dst_type, *args)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        # An explicit fp_downcast_rounding="rtz" keeps the interpreter's truncation (correct there).
        if rounding_mode is not None and rounding_mode != interp._ir.ROUNDING_MODE.RTNE:
            return orig_fp_to_fp(self, src, dst_type, rounding_mode)
        return float_cast(self, src, dst_type, orig_fp_to_fp, rounding_mode)

    def cast_impl(self, src, dst_type):
        return float_cast(self, src, dst_type, orig_cast)

    def _supported(fn):
        # create_dot is only reached for float operands the interpreter knows; fall back otherwise.
        def wrapper(self, a, b, d, *args):
            if _handled(a.dtype.scalar) and _handled(b.dtype.scalar):
                return fn(self, a, b, d, *args)
            return ORIGINALS["create_dot"](self, a, b, d, *args)

        return wrapper

    builder_cls.create_dot = _supported(create_dot)
    builder_cls.create_fp_to_fp = create_fp_to_fp
    builder_cls.cast_impl = cast_impl
    # the fp_ext / fp_trunc lambdas look up cast_impl on self at call time, so they follow.
    _APPLIED = True
    return True


def remove() -> None:
    """Undo :func:`apply` (tests use this to show each correction is needed)."""
    global _APPLIED
    if not _APPLIED:
        return
    from triton.runtime import interpreter as interp

    for name, fn in ORIGINALS.items():
        setattr(interp.InterpreterBuilder, name, fn)
    _APPLIED = False


def is_applied() -> bool:
    return _APPLIED
