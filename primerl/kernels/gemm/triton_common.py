"""What the two Triton GEMM launcher modules share (:mod:`.triton` picks the mode and tiles,
:mod:`.triton_fp8` launches the FP8 TMA kernels): the M-grouped launch modes, the interpreter flag,
the device's SM count and architecture, and host-side integer helpers.

:func:`primerl.kernels.aot.capture_launches` replaces :func:`num_sms` and :func:`arch_major` here
with a target card's, so both launcher modules read them through this module
(``common.num_sms()``), never a copy of the name.
"""

from __future__ import annotations

import functools

import torch

from .._backend import triton_interpreter_enabled as _interpreter_env

MODE_DENSE, MODE_TABLE, MODE_M_INDICES, MODE_MASKED = 0, 1, 2, 3  # MASKED: FP8 (TMA) kernel only
BN_PER_ROW_B = 64  # N tile with per-row B scales (recipe (1, 1, 128))


@functools.lru_cache(maxsize=None)
def triton_interpreter_enabled() -> bool:
    """TRITON_INTERPRET=1, read once: it must be set before the first @triton.jit runs, so it does not
    change later (reading the environment costs ~1-10 us, several times per launch)."""
    return _interpreter_env()


@functools.lru_cache(maxsize=None)
def num_sms() -> int:
    """The current CUDA device's SM count; 1 without one (or under the interpreter)."""
    if torch.cuda.is_available() and not triton_interpreter_enabled():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 1


@functools.lru_cache(maxsize=None)
def arch_major() -> int:
    """The current CUDA device's compute capability major (9 Hopper, 10 Blackwell); 9 without one."""
    if torch.cuda.is_available() and not triton_interpreter_enabled():
        return torch.cuda.get_device_capability(torch.cuda.current_device())[0]
    return 9


# host-side integer helpers: triton.cdiv / next_power_of_2 are ConstexprFunctions, ~10 us a call
# from Python, several per launch
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def pow2_clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, next_pow2(max(int(x), 1))))
