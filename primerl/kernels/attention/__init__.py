"""Attention over packed variable-length sequences that returns the log-sum-exp, its backward,
and the merge of partial attention results (the pieces ring attention is built from).

Layout (flash-attn's varlen convention): q ``[T, Hq, D]``, k/v ``[Tk, Hkv, D]`` hold B sequences
back to back, ``cu_seqlens`` int32 ``[B+1]`` their offsets (``None``: one sequence). GQA when
Hq = G * Hkv (query head h uses key head h // G). lse is ``[Hq, T]`` float32, natural log.

The non-square form (a query block against another key block, as each ring step is): pass
``cu_seqlens_k`` for the keys and, optionally, per-token positions. Query i sees key j iff they
are in the same sequence, ``k_positions[j] >= 0`` (negative: a masked key, e.g. padding) and,
when causal, ``k_positions[j] <= q_positions[i]``. Without positions a sequence's keys are
``0..Lk-1`` and its queries ``Lk-Lq .. Lk-1`` (bottom-right causal alignment, as flash-attn).
A query that sees no key returns ``out = 0``, ``lse = -inf``.

>>> import torch
>>> from primerl.kernels.attention import attention
>>> q, k, v = torch.randn(7, 4, 64), torch.randn(7, 2, 64), torch.randn(7, 2, 64)
>>> cu = torch.tensor([0, 3, 7], dtype=torch.int32)          # two sequences: 3 and 4 tokens
>>> out, lse = attention(q, k, v, cu_seqlens=cu, return_lse=True)   # [7, 4, 64], [4, 7]

Backends (``backend=``):

- ``"torch"``: the float32 reference (``reference.py``), the default on CPU.
- ``"triton"``: flash-attention-2 style forward and a recomputing backward in Triton (``triton.py``);
  every form (positions, any head_dim, float32); on CPU under TRITON_INTERPRET=1. The launchers run
  as ``primerl::`` custom ops (``triton_ops.py``): traceable by torch.compile and FakeTensor.
- ``"cudnn"``: cuDNN's fused attention, what SDPA runs on Hopper, per run of equal-length
  sequences (``cudnn.py``). CUDA, bf16/fp16, head_dim % 8 == 0 up to 128, default positions,
  causal only on square blocks (Lq == Lk per sequence).
- ``"varlen_flash"``: torch's bundled Flash Attention 2 on the packed batch (``varlen_flash.py``).
  CUDA, bf16/fp16, head_dim % 8 == 0 up to 256, default positions (any Lq, Lk: causal is
  bottom-right aligned), native GQA.
- ``"flash_attn"``: the flash-attn package's ``flash_attn_varlen_func``, only when named; no
  positions, lse not differentiable.
- ``"sdpa"``: torch's SDPA kernels per run of equal-length sequences, CPU and CUDA, only when
  named (on CPU several times faster than the reference; see ``sdpa.py``).

``backend=None`` on CUDA picks, per call: ``"cudnn"`` when it covers the case and the batch is at
most ``cudnn.MAX_RUNS`` runs of equal-length sequences; else ``"varlen_flash"`` when it covers the
case; else ``"triton"`` (explicit positions, float32 inputs, head_dims the torch kernels lack).
Ring attention (``primerl.parallel.context``) cuts each step into pseudo-sequences with the
default mask, so its steps take the torch kernels too. A named backend that cannot compute the case raises
``BackendUnavailableError`` with the reason. All of them return lse and take a gradient through
it (cudnn and varlen_flash by widening the head dim in the backward; see ``varlen_flash.py``);
their backward takes an external (ring-merged) out/lse.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace

import torch

from .._backend import BackendUnavailableError, resolve_backend
from .._value_checks import check_values
from . import reference

__all__ = [
    "mla_attention",
    "attention",
    "attention_forward",
    "attention_backward",
    "merge_attn_states",
    "merge_attn_states_",
    "AttentionSpec",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SUPPORTED = ("torch", "triton", "flash_attn", "sdpa", "varlen_flash", "cudnn")
# torch's own fused CUDA kernels: availability depends on the case (dtype, head_dim, mask form), so
# they are checked here per call rather than in primerl.kernels._backend
_TORCH_CUDA = ("varlen_flash", "cudnn")


@dataclass(frozen=True)
class AttentionSpec:
    """Validated mask description shared by forward and backward (positions None = defaults).

    ``max_seqlen_q/k`` and ``host_cu_q/k`` are the offsets' values on the host: only the GPU kernels
    (grid sizes, cuDNN's runs) need them, so they are filled (:func:`_host_spec`, a read of
    ``cu_seqlens``) only for those backends, or given by the caller (``max_seqlen=``). The torch
    backend never reads them: it runs without a host read, under torch.compile and FakeTensor.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    causal: bool
    softmax_scale: float
    q_positions: torch.Tensor | None
    k_positions: torch.Tensor | None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    host_cu_q: tuple[int, ...] = ()  # cu_seqlens values on the host (read once, cached per tensor)
    host_cu_k: tuple[int, ...] = ()
    num_q: int | None = None  # token counts T, Tk (None: read from the offsets' last values)
    num_k: int | None = None

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_positions is not None:
            return self.q_positions, self.k_positions
        return reference.default_positions(self.cu_seqlens_q, self.cu_seqlens_k, self.num_q, self.num_k)


# cu_seqlens values read on the host, by tensor identity and version: on CUDA a read is a sync, and
# every layer of a model (every step of a ring) passes the same tensor again. Eager GPU paths only.
_CU_CACHE: dict[int, tuple[weakref.ref, int, tuple]] = {}


def _host_values(cu: torch.Tensor) -> tuple[int, ...]:
    hit = _CU_CACHE.get(id(cu))
    if hit is not None and hit[0]() is cu and hit[1] == cu._version:
        return hit[2]
    vals = tuple(cu.tolist())
    if len(_CU_CACHE) > 256:
        _CU_CACHE.clear()
    _CU_CACHE[id(cu)] = (weakref.ref(cu), cu._version, vals)
    return vals


def _host_spec(spec: AttentionSpec, need_offsets: bool = True) -> AttentionSpec:
    """``spec`` with the offsets' host values (a read of cu_seqlens, cached per tensor): what the GPU
    kernels need. With ``need_offsets`` False and both max_seqlen given, nothing is read."""
    if spec.host_cu_q or (not need_offsets and spec.max_seqlen_q is not None and spec.max_seqlen_k is not None):
        return spec
    cq, ck = _host_values(spec.cu_seqlens_q), _host_values(spec.cu_seqlens_k)
    longest = lambda c: max((b - a for a, b in zip(c, c[1:])), default=0)  # noqa: E731
    return replace(spec, host_cu_q=cq, host_cu_k=ck,
                   max_seqlen_q=longest(cq) if spec.max_seqlen_q is None else spec.max_seqlen_q,
                   max_seqlen_k=longest(ck) if spec.max_seqlen_k is None else spec.max_seqlen_k)


def _check_cu(op: str, name: str, cu, total: int, device) -> torch.Tensor:
    """Shape, dtype and device checked in Python; the values (0, non-decreasing, ``total``) on the
    device (:func:`primerl.kernels.check_values`: no host read outside debug mode)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{op}: {name} must be a 1-D tensor [B+1] with B >= 1, got {getattr(cu, 'shape', type(cu))}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: {name} must be int32 (flash-attn convention), got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{op}: {name} is on {cu.device}, the tensors on {device}")
    ok = (cu[0] == 0) & (cu[-1] == total) & (cu.diff() >= 0).all()
    check_values(ok, f"{op}: {name} must start at 0, be non-decreasing and end at the token count",
                 lambda: f"end {total}; got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}")
    return cu.to(torch.int32).contiguous()


def _check_positions(op: str, name: str, pos, total: int, device):
    if pos is None:
        return None
    if not isinstance(pos, torch.Tensor) or pos.shape != (total,) or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: {name} must be an int32/int64 tensor of shape [{total}], got "
                         f"{getattr(pos, 'dtype', type(pos))} {tuple(getattr(pos, 'shape', ()))}")
    if pos.device != device:
        raise ValueError(f"{op}: {name} is on {pos.device}, the tensors on {device}")
    return pos.to(torch.int32).contiguous()


def _make_spec(op, q, k, v, cu_seqlens, cu_seqlens_k, causal, softmax_scale, q_positions, k_positions,
               max_seqlen=None, max_seqlen_k=None) -> AttentionSpec:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{op}: {name} must be a 3-D tensor [tokens, heads, head_dim], got {tuple(getattr(t, 'shape', ()))}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{op}: {name} dtype must be one of {_DTYPES}, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    T, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    Tk, Hkv, Dk = k.shape
    if Dk != D:
        raise ValueError(f"{op}: head_dim of q ({D}) and k ({Dk}) differ")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{op}: query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    for name, m in (("max_seqlen", max_seqlen), ("max_seqlen_k", max_seqlen_k)):
        if m is not None and not (isinstance(m, int) and m >= 0):
            raise ValueError(f"{op}: {name} must be a non-negative int (the longest sequence), got {m!r}")
    host_q = host_k = ()
    if cu_seqlens is None:  # one sequence: the offsets are known without reading a device tensor
        if cu_seqlens_k is not None:
            raise ValueError(f"{op}: cu_seqlens_k given without cu_seqlens")
        cu_q = torch.tensor([0, T], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, Tk], dtype=torch.int32, device=q.device)
        max_seqlen, max_seqlen_k, host_q, host_k = T, Tk, (0, T), (0, Tk)
    else:
        if cu_seqlens_k is None:
            if Tk != T:
                raise ValueError(f"{op}: k has {Tk} tokens but q has {T}; pass cu_seqlens_k for a non-square block")
            cu_seqlens_k = cu_seqlens
            max_seqlen_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
        cu_q = _check_cu(op, "cu_seqlens", cu_seqlens, T, q.device)
        cu_k = cu_q if cu_seqlens_k is cu_seqlens else _check_cu(op, "cu_seqlens_k", cu_seqlens_k, Tk, q.device)
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"{op}: cu_seqlens ({cu_q.shape[0] - 1} sequences) and cu_seqlens_k ({cu_k.shape[0] - 1}) differ")
    q_pos = _check_positions(op, "q_positions", q_positions, T, q.device)
    k_pos = _check_positions(op, "k_positions", k_positions, Tk, q.device)
    if (q_pos is None) != (k_pos is None):
        dq_pos, dk_pos = reference.default_positions(cu_q, cu_k, T, Tk)
        q_pos = dq_pos if q_pos is None else q_pos
        k_pos = dk_pos if k_pos is None else k_pos
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    elif not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"{op}: softmax_scale must be a positive float, got {softmax_scale!r}")
    return AttentionSpec(cu_q, cu_k, bool(causal), float(softmax_scale), q_pos, k_pos, max_seqlen, max_seqlen_k,
                         host_q, host_k, T, Tk)


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
        return cudnn.unsupported_reason(q, spec) or (_torch_cuda_reason("varlen_flash", q, spec, True) if dlse else None)
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


def _tracing(q: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or q.is_meta or is_fake(q)


class _AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec, backend):
        impl = _impl(backend)
        out, lse = impl.forward(q, k, v, spec, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.backend = spec, backend
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _impl(ctx.backend).backward(dout.contiguous(), q, k, v, out, lse, dlse, ctx.spec)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


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
        out, lse = _AttentionFn.apply(q, k, v, spec, be)
    return (out, lse) if return_lse else out


def attention_forward(
    q, k, v, *, cu_seqlens=None, causal=True, softmax_scale=None, backend=None, cu_seqlens_k=None,
    q_positions=None, k_positions=None, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward alone, outside autograd: (out ``[T, Hq, D]`` in ``out_dtype`` (default q.dtype),
    lse ``[Hq, T]`` float32). Ring attention calls it once per key block."""
    spec = _make_spec("attention_forward", q, k, v, cu_seqlens, cu_seqlens_k, causal, softmax_scale, q_positions, k_positions)
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
        raise ValueError(f"{op}: dout and out must have q's shape {tuple(q.shape)}, got {tuple(dout.shape)}, {tuple(out.shape)}")
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
        raise ValueError(f"{op}: out_a and out_b must both be [T, H, D], got {tuple(out_a.shape)} and {tuple(out_b.shape)}")
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
    be = resolve_backend("merge_attn_states", backend, out_a.device, supported=("torch", "triton"), preference=("triton", "torch"))
    if be == "triton":
        return _impl("triton").merge_attn_states(out_a, lse_a, out_b, lse_b, inplace=False)
    return reference.merge_attn_states(out_a, lse_a, out_b, lse_b)


def merge_attn_states_(out, lse, out_b, lse_b, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`merge_attn_states`: merges (out_b, lse_b) into ``out`` and ``lse`` (both
    overwritten; keep ``out`` float32 to accumulate many blocks without rounding). Not differentiable."""
    _check_merge("merge_attn_states_", out, lse, out_b, lse_b)
    be = resolve_backend("merge_attn_states_", backend, out.device, supported=("torch", "triton"), preference=("triton", "torch"))
    with torch.no_grad():
        if be == "triton":
            return _impl("triton").merge_attn_states(out, lse, out_b, lse_b, inplace=True)
        new_out, new_lse = reference.merge_attn_states(out, lse, out_b, lse_b)
        out.copy_(new_out)
        lse.copy_(new_lse)
    return out, lse


from .mla import mla_attention  # noqa: E402  (Dqk != Dv, e.g. MLA 192/128; uses attention above)
