"""The GEMM backend dispatcher: the backend names each public op resolves ``backend=`` against
(:func:`primerl.kernels._backend.resolve_backend`), and the module that runs a resolved backend.

Every backend module has the interface of :mod:`.reference` (the launchers' argument order, see
each op in :mod:`.fp8_gemm` and ``__init__``): ``"torch"`` -> :mod:`.reference`; ``"triton"`` ->
:mod:`.triton_ops` (the Triton launchers as custom ops: traceable), or :mod:`.triton` itself
during AOT capture (:func:`primerl.kernels._opaque.launching_directly`); ``"deep_gemm"`` ->
:mod:`.deep_gemm`. (``"cublas"``, dense FP8 only, is chosen and run inside
:func:`.fp8_gemm.fp8_gemm_nt`.) The backend modules are imported on first use: Triton and DeepGEMM
load only when a call needs them.
"""

from __future__ import annotations

FP8_BACKENDS = ("torch", "triton", "deep_gemm")
PLAIN_BACKENDS = ("torch", "triton")
# bf16 dense / M-grouped GEMMs default to torch (cuBLAS, torch._grouped_mm) on CUDA: the Triton
# kernels are chosen explicitly until `python -m bench gemm` measures them faster on a GPU.
CUBLAS_FIRST = ("torch", "triton")


def backend_module(backend: str):
    """The module whose functions run ``backend`` (a name :func:`resolve_backend` returned)."""
    if backend == "triton":
        from .._opaque import launching_directly

        if launching_directly():
            from . import triton as impl
        else:
            from . import triton_ops as impl  # the Triton launchers as custom ops (traceable)
    elif backend == "deep_gemm":
        from . import deep_gemm as impl
    elif backend == "torch":
        from . import reference as impl
    else:
        raise ValueError(f"gemm: no backend module for {backend!r}; backends: torch, triton, deep_gemm")
    return impl
