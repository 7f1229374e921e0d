"""Validation shared by the GEMM entry points: one message format (op, argument, expected, got),
raised before any work starts. Checks of index values (offsets monotonic, ids in range) go through
:func:`primerl.kernels.check_values`: a device-side assertion, no host read (a ValueError with the
values in debug mode)."""

from __future__ import annotations

import torch

from .._value_checks import check_values
from .layout import BLOCK

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _shape(t) -> str:
    return f"{tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_tensor(op: str, name: str, t, dims: int, dtypes: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{op}: {name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} dtype must be one of {dtypes}, got {t.dtype}")


def _check_same_device(op: str, **tensors) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(f"{op}: all tensors must be on one device; {name} is on {dev}, expected {first}")
    return first


def _check_out_dtype(op: str, out_dtype) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")


def _check_index(op: str, name: str, t, length: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: {name} must be a 1-D int32 tensor, got {_shape(t)} {getattr(t, 'dtype', '')}")
    if length is not None and t.numel() != length:
        raise ValueError(f"{op}: {name} must have {length} entries, got {t.numel()}")
    return t.to(torch.int32).contiguous()


def _check_offsets_content(op: str, offsets: torch.Tensor, num_rows: int) -> None:
    """offsets non-decreasing, >= 0, ending within the rows: a device-side check (no host read)."""
    if offsets.numel() == 0:
        return
    ok = (offsets[1:] >= offsets[:-1]).all() & (offsets[0] >= 0) & (offsets[-1] <= num_rows)
    # the row count only in the detail: formatting a symbolic size into the static message would
    # specialise a compiled graph on it (a recompile per packing)
    check_values(ok, f"{op}: offsets must be non-decreasing, >= 0 and at most the rows of the input",
                 lambda: f"{num_rows} rows, got {offsets.tolist()}")


def _check_m_indices_content(op: str, m_indices: torch.Tensor, num_groups: int, ascending: bool = False,
                             one_group_per_block: bool = True) -> None:
    """m_indices in [-1, G), and (kernels' layout) one group per 128-row block, groups ascending:
    device-side checks (no host read)."""
    if m_indices.numel() == 0:
        return
    check_values(((m_indices >= -1) & (m_indices < num_groups)).all(),
                 f"{op}: m_indices values must be in [-1, {num_groups})",
                 lambda: f"got min {int(m_indices.min())} max {int(m_indices.max())}")
    if not one_group_per_block:
        return
    blocks = m_indices.view(-1, BLOCK)
    hi = blocks.max(dim=1).values
    check_values(((blocks == hi[:, None]) | (blocks == -1)).all(),
                 f"{op}: every {BLOCK}-row block of m_indices must hold one group (or -1 padding); "
                 "build the layout with pad_to_contiguous")
    if ascending:
        owners = torch.cummax(hi, 0).values
        check_values(((hi < 0) | (hi == owners)).all(),
                     f"{op}: groups in m_indices must appear in ascending order (pad_to_contiguous's layout)")
