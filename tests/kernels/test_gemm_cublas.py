"""The ``"cublas"`` backend of fp8_gemm_nt (torch's cuBLAS blockwise FP8, F.scaled_mm) and the
dense FP8 dispatch of ``backend=None``.

CPU: the scale layouts (values bitwise, strides as cuBLAS wants them, accepted by torch's own
shape/stride checks on meta tensors), the decision logic (static reasons, probe outcomes,
which backend ``None`` picks), the error of an explicit ``backend="cublas"`` that cannot run.
GPU: calc_diff < 1e-5 against the dequantize-then-fp32 reference (the bound of the other FP8
GEMM gpu tests), at the bench shapes and awkward ones.
"""

from __future__ import annotations

import pytest
import torch

from primerl.kernels import BackendUnavailableError
from primerl.kernels import gemm as G
from primerl.kernels.fp8 import quant_per_block, quant_per_token_group
from primerl.kernels.gemm import cublas
from primerl.kernels.gemm import fp8_gemm as F8
from primerl.kernels.gemm import reference as R
from primerl.kernels.testing import calc_diff

HAS_CUDA = torch.cuda.is_available()
E4M3 = torch.float8_e4m3fn


def _pair(m, n, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=torch.bfloat16)
    return quant_per_token_group(x, 128), quant_per_block(w)


@pytest.mark.parametrize("m,sk", [(1, 1), (3, 3), (200, 4), (4096, 56)])
def test_scale_a_layout_values_and_strides(m, sk):
    sf = torch.rand(m, sk, generator=torch.Generator().manual_seed(m)) + 0.5
    out = cublas.scale_a_layout(sf)
    assert torch.equal(out, sf) and out.shape == (m, sk)
    assert out.stride(0) == 1 and (out.stride(1) == m or sk == 1)


@pytest.mark.parametrize("m,sk", [(4, 1), (128, 16), (4096, 56)])
def test_scale_a_layout_takes_mn_major_scales_without_a_copy(m, sk):
    # what bench gemm feeds backend=None (and DeepGEMM users pass): no per-call copy when M % 4 == 0
    sf = torch.rand(m, sk, generator=torch.Generator().manual_seed(m)) + 0.5
    mn = G.get_mn_major_tma_aligned_tensor(sf)
    out = cublas.scale_a_layout(mn)
    assert torch.equal(out, sf) and out.data_ptr() == mn.data_ptr()


@pytest.mark.parametrize("nb,sk", [(1, 1), (2, 3), (17, 56), (3, 5)])
@pytest.mark.parametrize("pad_k", [True, False])
def test_scale_b_layout_values_strides_padding(nb, sk, pad_k):
    sf = torch.rand(nb, sk, generator=torch.Generator().manual_seed(nb * sk)) + 0.5
    out = cublas.scale_b_layout(sf, pad_k)
    sk4 = -(-sk // 4) * 4 if pad_k else sk
    assert out.shape == (sk4, nb) and out.stride() == (1, sk4)
    assert torch.equal(out[:sk], sf.t())  # [kb, nb] holds block (nb, kb)
    assert bool((out[sk:] == 1).all())  # padding is finite


@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (3, 256, 384), (200, 384, 512), (4096, 2048, 7168)])
def test_layouts_pass_torch_shape_checks(m, n, k):
    """torch's own size/stride rules for (BlockWise1x128, BlockWise128x128), run on meta tensors."""
    f = torch.nn.functional
    aq = torch.empty(m, k, dtype=E4M3, device="meta")
    bq = torch.empty(n, k, dtype=E4M3, device="meta")
    sa = cublas.scale_a_layout(torch.ones(m, k // 128)).to("meta")
    sb = cublas.scale_b_layout(torch.ones(n // 128, k // 128), True).to("meta")
    sa = torch.empty_strided(sa.shape, sa.stride(), device="meta")
    sb = torch.empty_strided(sb.shape, sb.stride(), device="meta")
    out = f.scaled_mm(aq, bq.t(), sa, f.ScalingType.BlockWise1x128, sb, f.ScalingType.BlockWise128x128,
                      output_dtype=torch.bfloat16)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError):  # and the checks do bite: K-major A scales are refused
        bad = torch.empty(m, k // 128, device="meta") if m > 1 and k > 128 else torch.empty(m, 2, device="meta")
        f.scaled_mm(aq, bq.t(), bad, f.ScalingType.BlockWise1x128, sb, f.ScalingType.BlockWise128x128,
                    output_dtype=torch.bfloat16)


def test_emulated_cublas_semantics_match_reference():
    """Reading the converted scales the way cuBLAS defines them ([m, kb] for A, [kb, nb] for B)
    reproduces primerl's reference product bitwise (float32, same summation order)."""
    a, b = _pair(40, 384, 640, seed=3)
    sa, sb = cublas.scale_a_layout(a[1]), cublas.scale_b_layout(b[1])
    qa, qb = a[0].float(), b[0].float()
    kb = torch.arange(640) // 128
    nb = torch.arange(384) // 128
    got = (qa * sa[:, kb]) @ (qb * sb[kb][:, nb].t()).t()
    assert torch.equal(got, R.fp8_gemm_nt(a, b, torch.float32))


CAP = (9, 0)


@pytest.mark.parametrize("case,why", [
    (dict(capability=None), "CUDA"),
    (dict(capability=(10, 0)), "SM90"),
    (dict(capability=(8, 9)), "SM90"),
    (dict(a_dtype=torch.float8_e5m2), "e4m3"),
    (dict(gran=1), "(1, 128, 128)"),
    (dict(out_dtype=torch.float32), "bf16"),
    (dict(has_c=True), "accumulator"),
    (dict(n=136), "multiples of 16"),
    (dict(n=2120), "multiples of 16"),
    (dict(m=0), "non-empty"),
])
def test_static_reason_refuses(case, why):
    args = dict(m=128, n=2112, k=7168, a_dtype=E4M3, b_dtype=E4M3, gran=128, out_dtype=torch.bfloat16,
                has_c=False, capability=CAP)
    args.update(case)
    msg = cublas.static_reason(**args)
    assert msg is not None and why in msg


@pytest.mark.parametrize("m,n,k", [(128, 2112, 7168), (4096, 7168, 16384), (1, 16, 128), (3, 4096, 384)])
def test_static_reason_accepts(m, n, k):
    assert cublas.static_reason(m, n, k, E4M3, E4M3, 128, torch.bfloat16, False, CAP) is None


@pytest.mark.parametrize("support,m,n,k,ok", [
    (cublas.Support(True, True, True, True, ""), 3, 2112, 384, True),
    (cublas.Support(True, None, True, True, "x"), 16, 2112, 384, False),   # K/128 = 3, no layout worked
    (cublas.Support(True, None, True, True, "x"), 16, 2112, 512, True),    # K/128 = 4: both layouts agree
    (cublas.Support(True, True, False, True, "x"), 16, 2112, 512, False),  # partial N block refused
    (cublas.Support(True, True, False, True, "x"), 16, 2048, 512, True),
    (cublas.Support(True, True, True, False, "x"), 3, 2048, 512, False),   # odd M refused
    (cublas.Support(True, True, True, False, "x"), 128, 2048, 512, True),
    (cublas.Support(False, None, False, False, "probe failed"), 16, 2048, 512, False),
])
def test_support_reason(support, m, n, k, ok):
    assert (cublas.support_reason(support, m, n, k) is None) == ok


def test_backend_none_picks_cublas_where_it_applies(monkeypatch):
    """The decision, with the device facts replaced: cuBLAS when its reason is None, else the
    DeepGEMM / Triton order (never cuBLAS with a reason)."""
    a, b = _pair(8, 256, 256)
    cuda = torch.device("cuda")
    monkeypatch.setattr(cublas, "reason", lambda *args: None)
    assert F8._dense_backend("fp8_gemm_nt", None, a, b, 128, torch.bfloat16, None, cuda) == "cublas"
    assert F8._dense_backend("fp8_gemm_nt", "cublas", a, b, 128, torch.bfloat16, None, cuda) == "cublas"
    monkeypatch.setattr(cublas, "reason", lambda *args: "not here")
    assert F8._dense_backend("fp8_gemm_nt", None, a, b, 128, torch.bfloat16, None, cuda) != "cublas"
    with pytest.raises(BackendUnavailableError, match="backend 'cublas' is unavailable: not here"):
        F8._dense_backend("fp8_gemm_nt", "cublas", a, b, 128, torch.bfloat16, None, cuda)
    # CPU tensors never consult cuBLAS
    monkeypatch.setattr(cublas, "reason", lambda *args: pytest.fail("consulted on CPU"))
    assert F8._dense_backend("fp8_gemm_nt", None, a, b, 128, torch.bfloat16, None, torch.device("cpu")) == "torch"


def test_explicit_cublas_on_cpu_raises_before_work():
    a, b = _pair(8, 256, 256)
    with pytest.raises(BackendUnavailableError, match="cublas"):
        G.fp8_gemm_nt(a, b, backend="cublas")
    with pytest.raises(ValueError, match="not implemented"):  # the grouped ops have no cuBLAS path
        G.m_grouped_fp8_gemm_nt_offsets(a, (b[0][None], b[1][None]), torch.tensor([8], dtype=torch.int32),
                                        backend="cublas")


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_cublas_probe_passes_on_hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuBLAS blockwise FP8 is an SM90 path")
    s = cublas.probe(torch.cuda.current_device())
    assert s.ok, s.reason
    print(f"cublas probe: pad_k={s.pad_k} partial_n={s.partial_n} notes={s.reason!r}")


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(128, 7168, 2048), (4096, 2112, 7168), (3, 4096, 512), (77, 256, 384),
                                   (4096, 24576, 1536)])
def test_cublas_fp8_gemm_nt_gpu(m, n, k):
    a, b = _pair(m, n, k, seed=m + n, device="cuda")
    deq = R.fp8_gemm_nt(a, b, torch.float32)
    why = cublas.reason(m, n, k, E4M3, E4M3, 128, torch.bfloat16, False, a[0].device)
    if why is not None:
        with pytest.raises(BackendUnavailableError, match="cublas"):
            G.fp8_gemm_nt(a, b, backend="cublas")
        pytest.skip(f"cuBLAS blockwise does not take {m}x{n}x{k} here: {why}")
    out = G.fp8_gemm_nt(a, b, backend="cublas")
    assert out.dtype == torch.bfloat16 and calc_diff(out, deq) < 1e-5
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert G.fp8_gemm_nt(a, b, d, backend="cublas") is d and torch.equal(d, out)
    assert torch.equal(G.fp8_gemm_nt(a, b), out)  # backend=None takes it
    # A's scales already MN-major (DeepGEMM's TMA-aligned layout): taken without a copy, same bits
    a_mn = (a[0], G.get_mn_major_tma_aligned_tensor(a[1]))
    if m % 4 == 0:
        assert cublas.scale_a_layout(a_mn[1]).data_ptr() == a_mn[1].data_ptr()
    assert torch.equal(G.fp8_gemm_nt(a_mn, b, backend="cublas"), out)


@pytest.mark.gpu
def test_backend_none_float32_out_is_not_cublas():
    a, b = _pair(64, 256, 512, device="cuda")
    out = G.fp8_gemm_nt(a, b, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and calc_diff(out, R.fp8_gemm_nt(a, b, torch.float32)) < 1e-5
