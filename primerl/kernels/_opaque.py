"""Helpers for ops that run eager code torch.compile cannot trace (a loop over host values of a CPU
index tensor, ``torch._grouped_mm`` on a dtype its meta kernel rejects): such code is wrapped in a
``torch.library.custom_op`` whose fake kernel gives the output's shape and dtype, so compile,
FakeTensorMode and meta tensors see one opaque node, and eager runs the very same code (bitwise the
same results traced or not).

:func:`tracing` tells whether tensors are being traced; :func:`recompute_grads` is the generic
backward of such an op: it runs the op's eager code again under autograd, inside the backward
custom op, and returns the input gradients (bitwise what autograd through the eager code gives).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

# The dispatch key sets of plain eager code, captured at import: inside a custom op's kernel
# autograd is excluded, and recompute_grads restores them to differentiate the eager code there.
_EAGER_INCLUDE = torch._C._dispatch_tls_local_include_set()
_EAGER_EXCLUDE = torch._C._dispatch_tls_local_exclude_set()


# Ahead-of-time capture (primerl.kernels.aot) runs ops on storage-less meta tensors that report
# cuda and records the Triton launches; a custom op would send those tensors to its fake kernel,
# so the capture asks for the launcher modules themselves.
_direct_launches = False


@contextlib.contextmanager
def direct_triton_launches():
    """Within the block, ``backend="triton"`` calls the Triton launchers directly, not through
    their ``primerl::*_triton`` custom ops (for :func:`primerl.kernels.aot.capture_launches`)."""
    global _direct_launches
    old, _direct_launches = _direct_launches, True
    try:
        yield
    finally:
        _direct_launches = old


def launching_directly() -> bool:
    return _direct_launches


def tracing(*tensors: torch.Tensor) -> bool:
    """True under torch.compile, or when a tensor is fake (FakeTensorMode, export) or on meta."""
    if torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import is_fake

    return any(isinstance(t, torch.Tensor) and (t.is_meta or is_fake(t)) for t in tensors)


def recompute_grads(fn: Callable[..., torch.Tensor], args: Sequence, needs: Sequence[bool],
                    grad: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of ``fn(*args)`` (contracted with ``grad``) for the tensor args flagged in ``needs``;
    an arg that is not needed gets an empty tensor (custom ops cannot return None)."""
    with torch._C._ForceDispatchKeyGuard(_EAGER_INCLUDE, _EAGER_EXCLUDE), torch.enable_grad():
        leaves = [a.detach().requires_grad_(n) if isinstance(a, torch.Tensor) and n else
                  (a.detach() if isinstance(a, torch.Tensor) else a) for a, n in zip(args, needs)]
        out = fn(*leaves)
        wanted = [leaf for leaf, n in zip(leaves, needs) if n]
        grads = list(torch.autograd.grad(out, wanted, grad.contiguous(), allow_unused=True)) if wanted else []
    result = []
    for a, n in zip(args, needs):
        if not isinstance(a, torch.Tensor):
            continue
        if n:
            g = grads.pop(0)
            result.append(torch.zeros_like(a) if g is None else g)
        else:
            result.append(a.new_empty(0))
    return result
