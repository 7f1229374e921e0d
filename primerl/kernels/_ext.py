"""The one place that loads the compiled CUDA extension ``primerl._C`` (built from csrc/), and the
schemas and fake kernels of the ops it implements.

The ops' schemas are defined here, in Python, and csrc/ registers only their CUDA kernels
(``TORCH_LIBRARY_IMPL(primerl, CUDA, m)``). So ``torch.ops.primerl.fp8_quant_*`` / ``moe_*`` exist
with fake kernels whether the extension was built or not: torch.compile, FakeTensorMode, meta
tensors and ``torch.export`` trace the ``backend="cuda"`` paths on any machine (CI traces them here
with fake CUDA tensors), and the extension itself, when built, is checked against these schemas by
the dispatcher at import (the kernel signatures C++ infers must match them). Without the extension
a call on CUDA tensors raises an error naming it (no silent fallback). An extension built from
older sources, which defined the schemas itself, is still accepted: a schema already registered is
not defined again, and the fake kernels are registered either way.

Legend: T tokens, k experts per token, n = T*k slots, E experts, D model dim.
"""

from __future__ import annotations

import torch

try:
    from primerl import _C as cuda_ext  # noqa: F401

    HAS_CUDA_EXT = True
    CUDA_EXT_ERROR = None
except ImportError as exc:  # pure-Python install: no extension was built
    cuda_ext = None
    HAS_CUDA_EXT = False
    CUDA_EXT_ERROR = str(exc)

# name -> schema of every op csrc/ implements (their *_binding.cpp files hold the CUDA kernels).
# The primerl namespace also holds Python custom ops: these names carry no backend suffix, the
# Triton launchers' ops end in _triton.
CSRC_OPS = {
    "fp8_quant_per_token_group":
        "(Tensor x, int group_size, ScalarType dtype, bool ue8m0, bool reciprocal) -> (Tensor, Tensor)",
    "fp8_quant_per_block":
        "(Tensor w, int block_n, int block_k, ScalarType dtype, bool ue8m0, bool reciprocal) -> (Tensor, Tensor)",
    "fp8_quant_rowwise": "(Tensor x, ScalarType dtype, bool reciprocal) -> (Tensor, Tensor)",
    "fp8_quant_tensorwise": "(Tensor x, ScalarType dtype, bool reciprocal) -> (Tensor, Tensor)",
    "moe_align": "(Tensor topk_ids, int num_experts, int block) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "moe_scatter_rows": "(Tensor src, Tensor row_map, Tensor? scale, int num_rows) -> Tensor",
}

_LIB = torch.library.Library("primerl", "FRAGMENT")  # kept alive for the process: holds the defs


def _has_schema(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"primerl::{name}", "")
    except RuntimeError:
        return False
    return True


def _not_built(name: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"torch.ops.primerl.{name} on CUDA tensors needs the CUDA extension primerl._C, which is "
                           f"not built (install with a CUDA torch and nvcc, or PRIMERL_BUILD_CUDA=1; import error: "
                           f"{CUDA_EXT_ERROR})")

    return kernel


for _name, _schema in CSRC_OPS.items():
    if not _has_schema(_name):
        _LIB.define(_name + _schema)
    if not HAS_CUDA_EXT:
        _LIB.impl(_name, _not_built(_name), "CUDA")


# ------------------------------------------------------------------------------ fake kernels
# Output shapes and dtypes of the CUDA kernels (csrc/*/..._binding.cpp allocate their outputs
# contiguous on the input's device), with the shape checks those kernels make.


def _fake(name: str):
    return lambda fn: torch.library.register_fake(f"primerl::{name}", fn, lib=_LIB)


@_fake("fp8_quant_per_token_group")
def _(x, group_size, dtype, ue8m0, reciprocal):
    """x [..., K] -> q [..., K] fp8, sf [..., K / group_size] float32."""
    torch._check(x.dim() >= 1, lambda: "fp8_quant_per_token_group: input must have at least 1 dim")
    torch._check(group_size > 0 and x.shape[-1] % group_size == 0,
                 lambda: f"fp8_quant_per_token_group: K={x.shape[-1]} must be divisible by group_size={group_size}")
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((*x.shape[:-1], x.shape[-1] // group_size),
                                                          dtype=torch.float32)


@_fake("fp8_quant_per_block")
def _(w, block_n, block_k, dtype, ue8m0, reciprocal):
    """w [(G,) N, K] -> q like w, sf [(G,) ceil(N / block_n), ceil(K / block_k)] float32."""
    torch._check(w.dim() in (2, 3), lambda: f"fp8_quant_per_block: w must be [N, K] or [G, N, K], got {w.shape}")
    torch._check(block_n > 0 and block_k > 0, lambda: "fp8_quant_per_block: block sizes must be positive")
    n, k = w.shape[-2:]
    sf = (*w.shape[:-2], -(-n // block_n), -(-k // block_k))
    return w.new_empty(w.shape, dtype=dtype), w.new_empty(sf, dtype=torch.float32)


@_fake("fp8_quant_rowwise")
def _(x, dtype, reciprocal):
    """x [..., K] -> q [..., K] fp8, sf [..., 1] float32."""
    torch._check(x.dim() >= 1, lambda: "fp8_quant_rowwise: input must have at least 1 dim")
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@_fake("fp8_quant_tensorwise")
def _(x, dtype, reciprocal):
    """x -> q like x fp8, sf [] float32."""
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((), dtype=torch.float32)


@_fake("moe_align")
def _(topk_ids, num_experts, block):
    """topk_ids [T, k] -> row_of_slot [n], sorted_slots [P], block_expert [ceil(P / block)], total [1],
    ends [E], all int32, with the static bound P = n + E * (block - 1)."""
    torch._check(num_experts > 0 and block > 0, lambda: "moe_align: num_experts and block must be positive")
    n = topk_ids.numel()
    bound = n + num_experts * (block - 1)
    new = lambda *shape: topk_ids.new_empty(shape, dtype=torch.int32)  # noqa: E731
    return new(n), new(bound), new(-(-bound // block)), new(1), new(num_experts)


@_fake("moe_scatter_rows")
def _(src, row_map, scale, num_rows):
    """src [T, D], row_map [T, k] int32 -> out [num_rows, D] in src's dtype."""
    torch._check(src.dim() == 2, lambda: "moe_scatter_rows: src must be a 2-D tensor")
    torch._check(row_map.dim() == 2 and row_map.shape[0] == src.shape[0] and row_map.dtype == torch.int32,
                 lambda: "moe_scatter_rows: row_map must be int32 [T, k] with T = src rows")
    return src.new_empty(num_rows, src.shape[1])
