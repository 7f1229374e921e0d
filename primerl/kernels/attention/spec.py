"""The validated description of one attention call (:class:`AttentionSpec`): offsets, causal flag,
softmax scale, positions, and the offsets' host values the GPU kernels need (read once per tensor,
cached). Every backend (:mod:`.ops` dispatches to them) and the custom ops (:mod:`.triton_ops`)
take it.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace

import torch

from .._value_checks import check_values
from . import reference

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
            raise ValueError(f"{op}: {name} must be a 3-D tensor [tokens, heads, head_dim], got "
                             f"{tuple(getattr(t, 'shape', ()))}")
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
        raise ValueError(f"{op}: cu_seqlens ({cu_q.shape[0] - 1} sequences) and cu_seqlens_k "
                         f"({cu_k.shape[0] - 1}) differ")
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
