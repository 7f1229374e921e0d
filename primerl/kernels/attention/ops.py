"""The attention ops (see the package docstring): validation (:mod:`.spec`), the choice of backend
per call, the autograd Function around a backend's forward and recomputing backward, and the merge
of partial results.
"""

from __future__ import annotations

import torch

from .._backend import BackendUnavailableError, resolve_backend
from . import reference
from .spec import _DTYPES, AttentionSpec, _host_spec, _make_spec

_SUPPORTED = ("torch", "triton", "flash_attn", "sdpa", "varlen_flash", "cudnn")
# torch's own fused CUDA kernels: availability depends on the case (dtype, head_dim, mask form), so
# they are checked here per call rather than in primerl.kernels._backend
_TORCH_CUDA = ("varlen_flash", "cudnn")


def _impl(backend: str):
    if backend in ("triton", "mla_triton"):
        from .._opaque import launching_directly

        if launching_directly():  # AOT capture: the raw launchers (primerl.kernels.aot)
            from . import mla_triton, triton

            return triton if backend == "triton" else mla_triton
        from . import triton_ops  # the launchers as custom ops (traceable)

        return triton_ops if backend == "triton" else triton_ops.MLA
    elif backend == "flash_attn":
        from . import flash_attn_backend as impl
    elif backend in ("sdpa", "torch") and not _launching_directly():
        from . import host_ops  # custom ops: their host read of the offsets stays inside (traceable)

        return host_ops.SDPA if backend == "sdpa" else host_ops.TORCH
    elif backend == "sdpa":
        from . import sdpa as impl
    elif backend == "varlen_flash":
        from . import varlen_flash as impl
    elif backend == "cudnn":
        from . import cudnn as impl
    else:
        from . import _torch_impl as impl
    return impl


def _torch_cuda_reason(backend: str, q: torch.Tensor, spec: AttentionSpec, dlse: bool) -> str | None:
    """Why a torch CUDA-kernel backend cannot compute this case (None: it can)."""
    if backend == "cudnn":
        from . import cudnn

        # a gradient through lse runs varlen_flash's backward (cudnn.py says why)
        if dlse:
            return cudnn.unsupported_reason(q, spec) or _torch_cuda_reason("varlen_flash", q, spec, True)
        return cudnn.unsupported_reason(q, spec)
    from . import varlen_flash

    return varlen_flash.unsupported_reason(q, spec, dlse=dlse)


def _auto_cuda(q: torch.Tensor, spec: AttentionSpec, dlse: bool) -> str:
    """backend=None on CUDA: cuDNN for a few runs of equal-length sequences (square when causal),
    else torch's varlen Flash Attention 2, else (positions, float32, odd head_dim) Triton."""
    if _torch_cuda_reason("cudnn", q, spec, dlse) is None:
        from . import cudnn

        if len(cudnn.runs(spec)) <= cudnn.MAX_RUNS:
            return "cudnn"
    if _torch_cuda_reason("varlen_flash", q, spec, dlse) is None:
        return "varlen_flash"
    return resolve_backend("attention", None, q.device, supported=_SUPPORTED, preference=("triton", "torch"))


def _resolve(op, backend, q: torch.Tensor, spec: AttentionSpec, dlse: bool = False) -> tuple[str, AttentionSpec]:
    """The backend that runs this case, and the spec with the host values that backend needs.
    ``dlse``: a gradient through lse will be (or may be) needed."""
    if backend is None and q.device.type == "cuda":
        spec = _host_spec(spec)  # choosing cuDNN needs its runs of equal lengths
        return _auto_cuda(q, spec, dlse), spec
    if backend in _TORCH_CUDA:
        spec = _host_spec(spec, need_offsets=backend == "cudnn")
        reason = _torch_cuda_reason(backend, q, spec, dlse)
        if reason is not None:
            raise BackendUnavailableError(f"{op}: backend {backend!r} cannot run this case: {reason}")
        return backend, spec
    be = resolve_backend(op, backend, q.device, supported=_SUPPORTED, preference=("triton", "torch"))
    if be == "flash_attn" and spec.q_positions is not None:
        raise ValueError(f"{op}: backend 'flash_attn' does not take q_positions/k_positions; use 'triton' or 'torch'")
    if be == "flash_attn" or (be == "triton" and _launching_directly()):  # the kernel's max_seqlen / grid sizes
        spec = _host_spec(spec, need_offsets=False)
    # backend "triton" otherwise: the custom op reads the offsets itself when a max_seqlen is missing
    # (triton_ops.py), so nothing data-dependent is computed here
    return be, spec


def _launching_directly() -> bool:
    from .._opaque import launching_directly

    return launching_directly()


class _AttentionFn(torch.autograd.Function):
    """``(out, lse)``, or ``out`` alone when ``lse_grad`` is False (lse is then no output, so a traced
    graph passes no zero dlse: the backward is the one eager runs, bitwise)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, backend, lse_grad=True):
        impl = _impl(backend)
        out, lse = impl.forward(q, k, v, spec, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.backend = spec, backend
        ctx.set_materialize_grads(False)
        return (out, lse) if lse_grad else out

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _impl(ctx.backend).backward(dout.contiguous(), q, k, v, out, lse, dlse, ctx.spec)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    max_seqlen_k: int | None = None,
):
    """Softmax attention, differentiable in q, k, v (and through lse when returned).

    q ``[T, Hq, D]``, k/v ``[Tk, Hkv, D]`` -> out ``[T, Hq, D]`` (q.dtype), and lse ``[Hq, T]``
    float32 when ``return_lse``. ``softmax_scale`` defaults to 1/sqrt(D). See the module
    docstring for ``cu_seqlens_k`` and the positions (the non-square form).

    ``max_seqlen`` (``max_seqlen_k``): the longest query (key) sequence, as flash-attn takes it.
    Only the GPU kernels need it (grid sizes); given, the Triton and varlen_flash backends run
    without reading ``cu_seqlens`` on the host (cuDNN, and ``backend=None`` on CUDA which may pick
    it, read the offsets once per tensor). Without it the Triton backend's custom op reads the
    offsets inside itself (once per tensor; opaque to torch.compile, so no graph break). The torch
    backend (CPU default) never reads the host: it is traceable by ``torch.compile(fullgraph=True)``,
    FakeTensor and meta tensors, with symbolic token counts (a new packing does not recompile).
    """
    spec = _make_spec("attention", q, k, v, cu_seqlens, cu_seqlens_k, causal, softmax_scale, q_positions, k_positions,
                      max_seqlen, max_seqlen_k)
    # an lse the caller may differentiate: a backend that takes dlse in its backward
    be, spec = _resolve("attention", backend, q, spec, dlse=return_lse and torch.is_grad_enabled())
    if be == "torch":  # plain differentiable ops over the whole packed block: no host read
        q_pos, k_pos = spec.positions()
        out, lse = reference.attention_dense(q, k, v, spec.cu_seqlens_q, spec.cu_seqlens_k, spec.causal,
                                             spec.softmax_scale, q_pos, k_pos)
    elif be == "flash_attn":
        out, lse = _impl(be).differentiable(q, k, v, spec)
    else:
        if not return_lse:
            return _AttentionFn.apply(q, k, v, spec, be, False)
        out, lse = _AttentionFn.apply(q, k, v, spec, be, True)
    return (out, lse) if return_lse else out


def attention_forward(
    q, k, v, *, cu_seqlens=None, causal=True, softmax_scale=None, backend=None, cu_seqlens_k=None,
    q_positions=None, k_positions=None, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward alone, outside autograd: (out ``[T, Hq, D]`` in ``out_dtype`` (default q.dtype),
    lse ``[Hq, T]`` float32). Ring attention calls it once per key block."""
    spec = _make_spec("attention_forward", q, k, v, cu_seqlens, cu_seqlens_k, causal, softmax_scale, q_positions,
                      k_positions)
    be, spec = _resolve("attention_forward", backend, q, spec)
    if out_dtype is not None and out_dtype not in _DTYPES:
        raise ValueError(f"attention_forward: out_dtype must be one of {_DTYPES}, got {out_dtype}")
    with torch.no_grad():
        return _impl(be).forward(q, k, v, spec, out_dtype or q.dtype)


def attention_backward(
    dout, q, k, v, out, lse, *, dlse=None, cu_seqlens=None, causal=True, softmax_scale=None, backend=None,
    cu_seqlens_k=None, q_positions=None, k_positions=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one key block (flash-attention style, recomputing P from ``lse``).

    ``out``/``lse`` may be the merged result over many key blocks (ring attention): the block
    gradients then sum to the full gradient. dout ``[T, Hq, D]``, out ``[T, Hq, D]``, lse/dlse
    ``[Hq, T]``. Returns dq ``[T, Hq, D]``, dk and dv ``[Tk, Hkv, D]``, all float32.
    """
    op = "attention_backward"
    spec = _make_spec(op, q, k, v, cu_seqlens, cu_seqlens_k, causal, softmax_scale, q_positions, k_positions)
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"{op}: dout and out must have q's shape {tuple(q.shape)}, got {tuple(dout.shape)}, "
                         f"{tuple(out.shape)}")
    want = (q.shape[1], q.shape[0])
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is not None and (t.shape != want or t.dtype != torch.float32):
            raise ValueError(f"{op}: {name} must be float32 of shape {want}, got {t.dtype} {tuple(t.shape)}")
    be, spec = _resolve(op, backend, q, spec, dlse=dlse is not None)
    with torch.no_grad():
        grads = _impl(be).backward(dout.contiguous(), q, k, v, out, lse, dlse, spec)
    return tuple(g.float() for g in grads)  # the torch CUDA kernels return q.dtype


def _check_merge(op, out_a, lse_a, out_b, lse_b):
    if out_a.dim() != 3 or out_b.shape != out_a.shape:
        raise ValueError(f"{op}: out_a and out_b must both be [T, H, D], got {tuple(out_a.shape)} and "
                         f"{tuple(out_b.shape)}")
    want = (out_a.shape[1], out_a.shape[0])
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != want or t.dtype != torch.float32:
            raise ValueError(f"{op}: {name} must be float32 of shape {want} ([H, T]), got {t.dtype} {tuple(t.shape)}")
    for name, t in (("out_a", out_a), ("out_b", out_b)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{op}: {name} dtype must be one of {_DTYPES}, got {t.dtype}")


def merge_attn_states(out_a, lse_a, out_b, lse_b, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the attention over each.

    out ``[T, H, D]``, lse ``[H, T]`` float32 -> (out in out_a.dtype, lse float32). A block whose
    lse is -inf (it saw no key) is ignored exactly. The torch backend is differentiable; the
    Triton one is forward-only.
    """
    _check_merge("merge_attn_states", out_a, lse_a, out_b, lse_b)
    be = resolve_backend("merge_attn_states", backend, out_a.device, supported=("torch", "triton"),
                         preference=("triton", "torch"))
    if be == "triton":
        return _impl("triton").merge_attn_states(out_a, lse_a, out_b, lse_b, inplace=False)
    return reference.merge_attn_states(out_a, lse_a, out_b, lse_b)


def merge_attn_states_(out, lse, out_b, lse_b, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`merge_attn_states`: merges (out_b, lse_b) into ``out`` and ``lse`` (both
    overwritten; keep ``out`` float32 to accumulate many blocks without rounding). Not differentiable."""
    _check_merge("merge_attn_states_", out, lse, out_b, lse_b)
    be = resolve_backend("merge_attn_states_", backend, out.device, supported=("torch", "triton"),
                         preference=("triton", "torch"))
    with torch.no_grad():
        if be == "triton":
            return _impl("triton").merge_attn_states(out, lse, out_b, lse_b, inplace=True)
        new_out, new_lse = reference.merge_attn_states(out, lse, out_b, lse_b)
        out.copy_(new_out)
        lse.copy_(new_lse)
    return out, lse
