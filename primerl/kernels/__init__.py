"""Layer 0: ops on tensors. Each op family has a plain-PyTorch reference (the spec), a Triton
kernel and, where built, a CUDA kernel from csrc/. Every public op takes ``backend=``."""

from ._backend import (  # noqa: F401
    BackendStatus,
    BackendUnavailableError,
    backend_status,
    backends,
    resolve_backend,
    triton_interpreter_enabled,
)
from ._ext import HAS_CUDA_EXT  # noqa: F401
from ._value_checks import check_values, debug_checks, debug_checks_enabled, set_debug_checks  # noqa: F401

if triton_interpreter_enabled():
    # Before any kernel module defines a @triton.jit function: make the CPU interpreter compute
    # what a GPU computes (see _triton_interpreter for the measured discrepancies).
    from . import _triton_interpreter

    _triton_interpreter.apply()

from . import fp8  # noqa: E402,F401
from .fp8 import dequant, quant_per_block, quant_per_token_group, quant_rowwise, quant_tensorwise  # noqa: E402,F401
from . import attention  # noqa: E402,F401
from . import sparse_attention  # noqa: E402,F401
from .logprobs import fused_logprobs  # noqa: E402,F401
from . import moe  # noqa: E402,F401
from . import fp8_training, gemm  # noqa: E402,F401
from . import lora  # noqa: E402,F401

__all__ = [
    # backends and value checks
    "BackendStatus", "BackendUnavailableError", "backend_status", "backends", "resolve_backend",
    "triton_interpreter_enabled", "HAS_CUDA_EXT", "check_values", "debug_checks", "debug_checks_enabled",
    "set_debug_checks",
    # op families (subpackages) and their most used functions
    "fp8", "attention", "sparse_attention", "moe", "fp8_training", "gemm", "lora",
    "dequant", "quant_per_block", "quant_per_token_group", "quant_rowwise", "quant_tensorwise", "fused_logprobs",
]
