"""The one place that loads the compiled CUDA extension `primerl._C` (built from csrc/)."""

try:
    from primerl import _C as cuda_ext  # noqa: F401

    HAS_CUDA_EXT = True
    CUDA_EXT_ERROR = None
except ImportError as exc:  # pure-Python install: no extension was built
    cuda_ext = None
    HAS_CUDA_EXT = False
    CUDA_EXT_ERROR = str(exc)
