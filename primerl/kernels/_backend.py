"""Backend selection shared by every op in primerl.kernels.

Every public op takes ``backend=None | "torch" | "triton" | "cuda"`` (plus an external name where
one exists, e.g. ``"deep_gemm"``). ``None`` picks the fastest backend available for the tensors'
device: on CPU tensors that is always the plain-PyTorch reference. A named backend that cannot run
raises :class:`BackendUnavailableError` naming what is missing; nothing falls back silently.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass

import torch

from ._constant_result import assume_constant_result
from ._ext import CUDA_EXT_ERROR, HAS_CUDA_EXT

BUILTIN_BACKENDS = ("torch", "triton", "cuda")


class BackendUnavailableError(RuntimeError):
    """A named backend was asked for but cannot run here."""


@dataclass(frozen=True)
class BackendStatus:
    available: bool
    reason: str


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _triton_status() -> BackendStatus:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return BackendStatus(False, f"triton is not installed ({exc}); pip install 'triton>=3.6'")
    if triton_interpreter_enabled():
        return BackendStatus(True, f"triton {triton.__version__} under TRITON_INTERPRET=1 (CPU tensors)")
    if torch.cuda.is_available():
        return BackendStatus(True, f"triton {triton.__version__} on {torch.cuda.get_device_name()}")
    return BackendStatus(
        False,
        "no CUDA device; to run the Triton kernels on CPU set TRITON_INTERPRET=1 before importing primerl",
    )


def _cuda_status() -> BackendStatus:
    if not HAS_CUDA_EXT:
        return BackendStatus(
            False,
            "the CUDA extension primerl._C is not built (install with a CUDA torch and nvcc, "
            f"or PRIMERL_BUILD_CUDA=1; import error: {CUDA_EXT_ERROR})",
        )
    if not torch.cuda.is_available():
        return BackendStatus(False, "primerl._C is built but no CUDA device is visible")
    return BackendStatus(True, "primerl._C loaded")


@functools.lru_cache(maxsize=None)
def _external_status(module: str, pip_hint: str) -> BackendStatus:
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - placeholder packages raise all sorts of errors
        return BackendStatus(False, f"`import {module}` failed ({type(exc).__name__}: {exc}); {pip_hint}")
    if not torch.cuda.is_available():
        return BackendStatus(False, f"{module} imports but needs a CUDA device")
    return BackendStatus(True, f"{module} importable on {torch.cuda.get_device_name()}")


EXTERNAL_BACKENDS = {
    "deep_gemm": ("build DeepGEMM from source (the PyPI deep-gemm is a placeholder); "
                  "SM90 (Hopper) and SM100 (Blackwell)"),
    "flash_attn": "pip install flash-attn (builds against CUDA)",
}


# Backends made of torch's own fused kernels: always importable, on CPU and CUDA; only used when
# named (never picked by backend=None).
TORCH_KERNEL_BACKENDS = {
    "sdpa": "torch's scaled_dot_product_attention kernels (CPU flash, CUDA memory-efficient)",
}


# A compile-time constant: torch.compile calls it at trace time instead of tracing it (probing an
# external backend imports its module, which dynamo refuses to trace: backend="deep_gemm" /
# "flash_attn", and backend=None on CUDA, which tries DeepGEMM first, would break a fullgraph trace).
@assume_constant_result
def backend_status(name: str) -> BackendStatus:
    if name == "torch":
        return BackendStatus(True, f"plain PyTorch {torch.__version__} (the reference)")
    if name in TORCH_KERNEL_BACKENDS:
        return BackendStatus(True, f"{TORCH_KERNEL_BACKENDS[name]}, torch {torch.__version__}")
    if name == "triton":
        return _triton_status()
    if name == "cuda":
        return _cuda_status()
    if name in EXTERNAL_BACKENDS:
        return _external_status(name, EXTERNAL_BACKENDS[name])
    raise ValueError(f"unknown backend {name!r}; known: {_ALL_BACKENDS}")


_ALL_BACKENDS = BUILTIN_BACKENDS + tuple(EXTERNAL_BACKENDS) + tuple(TORCH_KERNEL_BACKENDS)


def backends() -> dict[str, BackendStatus]:
    """Every backend primerl knows, whether it can run here, and why (not)."""
    return {name: backend_status(name) for name in _ALL_BACKENDS}


def resolve_backend(
    op: str,
    backend: str | None,
    device: torch.device,
    supported: tuple[str, ...] = BUILTIN_BACKENDS,
    preference: tuple[str, ...] | None = None,
) -> str:
    """Return the backend that runs ``op`` on tensors living on ``device``.

    ``supported`` lists the backends the op implements; ``preference`` (fastest first) is the
    order tried when ``backend`` is None on a CUDA device.
    """
    if backend is None:
        if device.type != "cuda":
            return "torch"
        for name in preference or ("cuda", "triton", "torch"):
            if name in supported and backend_status(name).available:
                return name
        return "torch"
    if backend not in supported:
        raise ValueError(f"{op}: backend {backend!r} is not implemented; choose one of {supported} or None")
    status = backend_status(backend)
    if not status.available:
        raise BackendUnavailableError(f"{op}: backend {backend!r} is unavailable: {status.reason}")
    if backend == "triton" and device.type != "cuda" and not triton_interpreter_enabled():
        raise BackendUnavailableError(f"{op}: Triton on {device.type} tensors needs TRITON_INTERPRET=1")
    if backend == "triton" and device.type == "cuda" and triton_interpreter_enabled():
        raise BackendUnavailableError(f"{op}: TRITON_INTERPRET=1 is set but the tensors are on CUDA")
    if backend not in ("torch", "triton", *TORCH_KERNEL_BACKENDS) and device.type != "cuda":
        raise BackendUnavailableError(f"{op}: backend {backend!r} needs CUDA tensors, got {device.type}")
    return backend
