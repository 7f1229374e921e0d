"""cuBLAS blockwise FP8 GEMM: ``torch.nn.functional.scaled_mm`` with DeepSeek's scales (A 1x128,
B 128x128, float32), the ``"cublas"`` backend of :func:`primerl.kernels.gemm.fp8_gemm_nt`.

torch exposes cuBLASLt's block-scaled FP8 GEMM as ``F.scaled_mm(a, b_t, sa, ScalingType.BlockWise1x128,
sb, ScalingType.BlockWise128x128)`` (``torch._scaled_mm_v2`` underneath; in torch 2.10 / 2.11 and
2.13; CUDA >= 12.9, SM90 only, e4m3 operands, bf16 output). Its operand layouts:

* ``a`` ``[M, K]`` row-major, ``b_t`` ``[K, N]`` column-major (primerl's ``b.q [N, K]`` transposed);
  K and N multiples of 16.
* A scales ``[M, ceil(K/128)]`` outer-dim-major: strides ``(1, M)`` (primerl's K-major ``sf``
  transposed, no TMA padding: DeepGEMM's MN-major TMA-aligned layout pads M to a multiple of 4
  and is refused by cuBLAS unless M % 4 == 0).
* B scales ``[L4, ceil(N/128)]`` with strides ``(1, L4)``, ``L4 = round_up(ceil(K/128), 4)``:
  primerl's ``[ceil(N/128), K/128]`` K-major block scales with the K dim padded to a multiple of 4.
  Earlier torch builds took the unpadded ``[K/128, N/128]``; the two agree when K/128 % 4 == 0.

Which of these a given torch + cuBLAS accepts is measured once per device by :func:`probe` (three
small GEMMs compared with the dequantized reference); ``backend=None`` picks this path only where
the probe passed for the case at hand, and an explicit ``backend="cublas"`` raises
:class:`BackendUnavailableError` with the reason elsewhere.

Under torch.compile the probe is not traced (its GEMMs and host reads would break a fullgraph
trace): :func:`device_support` is a compile-time constant, run eagerly once per process. The call
itself (:func:`fp8_gemm_nt`) is ``F.scaled_mm`` on strided views of the scales: no host read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .._constant_result import assume_constant_result
from .layout import BLOCK
from .offsets import device_capability

SUPPORTED_ARCH = 9
PROBE_TOLERANCE = 1e-5  # calc_diff against the dequantized float32 product (the gpu tests' bound)


def api_reason() -> str | None:
    """None when this torch has the blockwise ``F.scaled_mm`` API, else why not."""
    fn = getattr(torch.nn.functional, "scaled_mm", None)
    kinds = getattr(torch.nn.functional, "ScalingType", None)
    if fn is None or kinds is None:
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm / ScalingType (added in torch 2.10)"
    if not all(hasattr(kinds, name) for name in ("BlockWise1x128", "BlockWise128x128")):
        return f"torch {torch.__version__}'s ScalingType lacks BlockWise1x128 / BlockWise128x128"
    return None


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def scale_a_layout(sf: torch.Tensor) -> torch.Tensor:
    """float32 ``sf[M, SK]`` (any strides) -> the same values with strides ``(1, M)`` (no copy when
    they are already so, e.g. DeepGEMM's MN-major TMA-aligned layout with M % 4 == 0)."""
    return sf.t().contiguous().t()


def scale_b_layout(sf: torch.Tensor, pad_k: bool = True) -> torch.Tensor:
    """float32 block scales ``sf[NB, SK]`` -> ``[SK4, NB]`` with strides ``(1, SK4)``, where
    ``SK4 = round_up(SK, 4)`` if ``pad_k`` else ``SK``; the padding is 1.0 (finite, never read)."""
    nb, sk = sf.shape
    sk4 = round_up(sk, 4) if pad_k else sk
    if sk4 == sk and sf.stride() == (sk, 1):
        return sf.t()  # already the layout: no copy
    buf = sf.new_ones(nb, sk4)
    buf[:, :sk] = sf
    return buf.t()


@dataclass(frozen=True)
class Support:
    """What :func:`probe` found on one device: ``ok`` (the base case runs and is correct),
    ``pad_k`` (B scales padded to 4 K blocks, or None when K/128 % 4 != 0 is not supported),
    ``partial_n`` (N not a multiple of 128 works), ``any_m`` (M not a multiple of 16 works),
    ``reason`` (why not, for the cases that fail)."""

    ok: bool
    pad_k: bool | None
    partial_n: bool
    any_m: bool
    reason: str


def static_reason(m: int, n: int, k: int, a_dtype, b_dtype, gran: int, out_dtype, has_c: bool,
                  capability: tuple[int, int] | None) -> str | None:
    """Why the cuBLAS blockwise path cannot take this case, from shapes and types alone (None: it can,
    subject to :func:`probe`). ``capability``: the device's (major, minor), None for a non-CUDA device."""
    if capability is None:
        return "needs CUDA tensors"
    if capability[0] != SUPPORTED_ARCH:
        return f"cuBLAS blockwise FP8 runs on SM90 (Hopper) only; the device is SM{capability[0]}{capability[1]}"
    if a_dtype != torch.float8_e4m3fn or b_dtype != torch.float8_e4m3fn:
        return f"needs float8_e4m3fn operands, got {a_dtype} and {b_dtype}"
    if gran != BLOCK:
        return "takes recipe (1, 128, 128) only (128x128 B scales), got per-row B scales (1, 1, 128)"
    if out_dtype != torch.bfloat16:
        return f"writes bf16 only, got out_dtype={out_dtype}"
    if has_c:
        return "has no float32 accumulator input c"
    if k % 16 or n % 16:
        return f"needs N and K multiples of 16, got N={n}, K={k}"
    if m == 0 or n == 0:
        return "needs a non-empty output"
    return None


def reason(m: int, n: int, k: int, a_dtype, b_dtype, gran: int, out_dtype, has_c: bool,
           device: torch.device) -> str | None:
    """None when ``backend="cublas"`` computes this case correctly on ``device``, else why not."""
    why = api_reason()
    if why is not None:
        return why
    cap = device_capability(device) if device.type == "cuda" else None
    why = static_reason(m, n, k, a_dtype, b_dtype, gran, out_dtype, has_c, cap)
    if why is not None:
        return why
    return support_reason(device_support(_index(device)), m, n, k)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def support_reason(s: Support, m: int, n: int, k: int) -> str | None:
    """Why a probed device cannot take M x N x K (None: it can)."""
    if not s.ok:
        return s.reason
    if m % 16 and not s.any_m:
        return f"M={m} is not a multiple of 16 and this cuBLAS build got such an M wrong ({s.reason})"
    if (k // BLOCK) % 4 and s.pad_k is None:
        return (f"K/128 = {k // BLOCK} is not a multiple of 4 and this cuBLAS build took neither B-scale layout "
                f"({s.reason})")
    if n % BLOCK and not s.partial_n:
        return f"N={n} is not a multiple of 128 and this cuBLAS build got a partial N block wrong ({s.reason})"
    return None


def _run(aq, asf, bq, bsf, pad_k: bool) -> torch.Tensor:
    f = torch.nn.functional
    return f.scaled_mm(aq, bq.t(), scale_a_layout(asf), f.ScalingType.BlockWise1x128,
                       scale_b_layout(bsf, pad_k), f.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)


def _try(m: int, n: int, k: int, pad_k: bool, device: torch.device) -> str | None:
    """One probe GEMM: None if it ran and matched the reference, else what went wrong."""
    from ..fp8 import quant_per_block, quant_per_token_group
    from ..testing import calc_diff
    from .reference import fp8_gemm_nt as ref

    g = torch.Generator(device="cpu").manual_seed(m * 7 + n * 3 + k)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device=device, dtype=torch.bfloat16)
    a, b = quant_per_token_group(x, BLOCK, backend="torch"), quant_per_block(w, backend="torch")
    try:
        out = _run(a[0], a[1], b[0], b[1], pad_k)
    except Exception as exc:  # noqa: BLE001 - any refusal means "not this layout"
        return f"{m}x{n}x{k}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    diff = calc_diff(out.float(), ref(a, b, torch.float32))
    if not diff < PROBE_TOLERANCE:
        return f"{m}x{n}x{k}: calc_diff {diff:.2e} against the reference (> {PROBE_TOLERANCE:g})"
    return None


@functools.lru_cache(maxsize=None)
def probe(device_index: int) -> Support:
    """Run a few small blockwise GEMMs on ``cuda:device_index`` (once per process) and record what
    this torch + cuBLAS gets right: the base case (M % 16, N % 128 == 0, K/128 % 4 == 0), K/128 = 3
    with padded (else unpadded) B scales, a partial last N block, an odd M."""
    device = torch.device("cuda", device_index)
    base = _try(256, 256, 512, True, device)
    if base is not None:
        return Support(False, None, False, False, f"cuBLAS blockwise probe failed: {base}")
    notes, pad_k = [], None
    for pad in (True, False):
        why = _try(256, 256, 384, pad, device)
        if why is None:
            pad_k = pad
            break
        notes.append(why)
    why_n = _try(256, 272, 512, True, device)
    why_m = _try(77, 256, 512, True, device)
    notes += [w for w in (why_n, why_m) if w is not None]
    return Support(True, pad_k, why_n is None, why_m is None, "; ".join(notes))


@assume_constant_result
def device_support(device_index: int) -> Support:
    """:func:`probe` of ``cuda:device_index``; torch.compile calls it at trace time and keeps the result
    as a constant instead of tracing the probe's GEMMs."""
    return probe(device_index)


def fp8_gemm_nt(a, b, d: torch.Tensor | None) -> torch.Tensor:
    """(aq [M, K], asf [M, K/128]) x (bq [N, K], bsf [ceil(N/128), K/128]) -> bf16 [M, N] (into
    ``d`` when given). The caller has checked :func:`reason`."""
    (aq, asf), (bq, bsf) = a, b
    pad_k = True
    if (aq.shape[1] // BLOCK) % 4:
        pad_k = bool(device_support(_index(aq.device)).pad_k)
    out = _run(aq, asf, bq, bsf, pad_k)
    return out if d is None else d.copy_(out)
