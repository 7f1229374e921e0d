"""Accuracy helpers shipped with the package, for primerl's tests and for users' own.

``calc_diff`` is DeepGEMM's metric: 1 - 2*sum(x*y) / sum(x*x + y*y) in float64 (0 means equal;
1e-5 means the two agree as well as two independent bf16 roundings do).
"""

from __future__ import annotations

import math

import torch
import torch.utils._python_dispatch


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


# ------------------------------------------------------------------------------ host reads

# Ops whose result needs the device's values on the host (a GPU synchronisation): scalar reads
# and ops whose output shape depends on the data.
HOST_READ_OPS = (
    "_local_scalar_dense", "item", "nonzero", "nonzero_static_unbounded", "bincount", "unique",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "masked_select", "equal",
    "repeat_interleave.Tensor", "tolist",
)


def _device_to_host(name, args, kwargs) -> bool:
    if name == "copy_":  # copy_(dst, src)
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"
    src, device = args[0], kwargs.get("device")
    return src.device.type != "cpu" and device is not None and torch.device(device).type == "cpu"


class count_host_reads(torch.utils._python_dispatch.TorchDispatchMode):
    """Count data-dependent host reads (``aten._local_scalar_dense``, ``nonzero``, ``bincount``,
    ...) while active; ``.counts`` maps op name to calls, ``.total`` sums them.

    Python-level reads ``.item()`` and ``bool(t)`` reach ``aten._local_scalar_dense``; a copy from
    a non-CPU device to the CPU counts as ``device_to_host``. ``Tensor.tolist()`` reads a CPU
    tensor's memory without any dispatch, so a mode cannot see it: with ``tolist=True`` the method
    is wrapped while the mode is active and each call counts as ``tolist`` (off by default: the
    kernels' CPU-only float32 grouped-GEMM branches read their offsets with it, which the GPU
    path never does). ``repeat_interleave`` counts only without ``output_size``.
    """

    def __init__(self, tolist: bool = False):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.where: list[str] = []
        self.tolist = tolist
        self._in_tolist = False

    def _hit(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
        import traceback

        frames = [f for f in traceback.extract_stack()[:-2] if "primerl" in f.filename]
        self.where.append(f"{name} at " + (f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"))

    def __enter__(self):
        if not self.tolist:
            return super().__enter__()
        self._own_tolist = "tolist" in torch.Tensor.__dict__
        self._tolist = torch.Tensor.tolist
        real, hit = self._tolist, self._hit

        def tolist(t, *args, **kwargs):
            hit("tolist")
            self._in_tolist = True  # its device-to-host copy (a GPU tensor) is this same read
            try:
                return real(t, *args, **kwargs)
            finally:
                self._in_tolist = False

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        if not self.tolist:
            return super().__exit__(*exc)
        if self._own_tolist:
            torch.Tensor.tolist = self._tolist
        else:
            del torch.Tensor.tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        overload = f"{name}.{func._overloadname}"
        hit = name in HOST_READ_OPS or overload in HOST_READ_OPS
        if name == "repeat_interleave" and kwargs.get("output_size") is not None:
            hit = False
        if hit:
            self._hit(name)
        elif name in ("_to_copy", "copy_") and not self._in_tolist and _device_to_host(name, args, kwargs):
            self._hit("device_to_host")
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
