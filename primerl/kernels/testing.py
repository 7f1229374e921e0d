"""Accuracy helpers shipped with the package, for primerl's tests and for users' own.

``calc_diff`` is DeepGEMM's metric: 1 - 2*sum(x*y) / sum(x*x + y*y) in float64 (0 means equal;
1e-5 means the two agree as well as two independent bf16 roundings do).
"""

from __future__ import annotations

import math

import torch


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of ``approx`` against ``reference``."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum()
    signal = ref.pow(2).sum()
    if noise == 0:
        return math.inf
    return float(10 * torch.log10(signal / noise))


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "tensor") -> None:
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{name}: shape/dtype {tuple(actual.shape)}/{actual.dtype} != {tuple(expected.shape)}/{expected.dtype}"
        )
    a = actual.contiguous().view(torch.uint8) if actual.element_size() == 1 else actual.contiguous()
    e = expected.contiguous().view(torch.uint8) if expected.element_size() == 1 else expected.contiguous()
    if a.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, e = a.view(bits), e.view(bits)
    mismatch = a != e
    if mismatch.any():
        idx = mismatch.nonzero()[0].tolist()
        n = int(mismatch.sum())
        raise AssertionError(
            f"{name}: {n} of {mismatch.numel()} elements differ bitwise; first at {idx}: "
            f"{actual[tuple(idx)].float().item()} vs {expected[tuple(idx)].float().item()}"
        )


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (a scale-aware relative error, robust to zeros in e)."""
    e = expected.double()
    scale = e.abs().max().clamp_min(1e-30)
    return float((actual.double() - e).abs().max() / scale)
