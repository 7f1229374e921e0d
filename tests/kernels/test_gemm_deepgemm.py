"""DeepGEMM's arguments and layouts on primerl's FP8 GEMMs (torch and Triton backends), the scale
layout helpers, and the deep_gemm adapter's architecture and input checks (capability query mocked)
and argument marshalling (a stand-in deep_gemm module: marshalling only; the real DeepGEMM is compared
with the torch backend only in the `gpu` tests, on a GPU where it is installed).

Metric: calc_diff (DeepGEMM's) against dequantize-then-fp32-matmul, < 1e-5; bitwise where the same
backend computes the same thing through two input formats. Outputs from torch.empty are NaN-poisoned
(conftest), padding rows of inputs are poisoned here.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from primerl.kernels import gemm as G
from primerl.kernels.fp8 import quant_per_block, quant_per_token_group
from primerl.kernels.gemm import deep_gemm as DG
from primerl.kernels.gemm import reference as R
from primerl.kernels.testing import assert_bitwise_equal, calc_diff

BACKENDS = ["torch", "triton"]
NAN = float("nan")


def _randn(*shape, seed, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _poison_rows(pair, rows_mask):
    q, sf = pair[0].clone(), pair[1].clone()
    q.view(torch.uint8)[rows_mask] = 0x7F
    sf[rows_mask] = NAN
    return q, sf


@pytest.fixture
def alignment():
    """Restores the global contiguous-layout alignment after a test changes it."""
    before = G.get_mk_alignment_for_contiguous_layout()
    yield
    G.set_mk_alignment_for_contiguous_layout(before)


# ------------------------------------------------------------------------------ d, c, recipes, packed scales


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_gemm_nt_output_d_and_accumulator_c(backend):
    x, w = _randn(70, 256, seed=0), _randn(200, 256, seed=1, scale=0.05)
    a, b = quant_per_token_group(x, 128), quant_per_block(w)
    deq = R.fp8_gemm_nt(a, b, torch.float32)
    d = torch.full((70, 200), NAN, dtype=torch.bfloat16)
    assert G.fp8_gemm_nt(a, b, d, backend=backend) is d and calc_diff(d, deq) < 1e-5
    c = _randn(70, 200, seed=2, scale=4.0, dtype=torch.float32)
    d32 = c.clone()  # DeepGEMM's accumulate-in-place: c aliases d
    out = G.fp8_gemm_nt(a, b, d32, d32, backend=backend)
    assert out is d32 and out.dtype == torch.float32 and calc_diff(out, deq + c) < 1e-6
    assert G.fp8_gemm_nt(a, b, c=c, out_dtype=torch.float32, backend=backend).dtype == torch.float32
    with pytest.raises(ValueError, match="accumulating into c needs a float32 output"):
        G.fp8_gemm_nt(a, b, c=c, backend=backend)
    with pytest.raises(ValueError, match=r"d must be a \(70, 200\) tensor"):
        G.fp8_gemm_nt(a, b, torch.empty(70, 199, dtype=torch.bfloat16), backend=backend)
    with pytest.raises(ValueError, match="out_dtype=torch.float16 disagrees with d.dtype=torch.bfloat16"):
        G.fp8_gemm_nt(a, b, d, out_dtype=torch.float16, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_recipe_1_1_128_per_row_b_scales(backend):
    """SM100's 1D1D recipe: B quantized per row (1 x 128) instead of per 128x128 block."""
    x, w = _randn(37, 256, seed=3), _randn(160, 256, seed=4, scale=0.05)
    a, b = quant_per_token_group(x, 128), quant_per_token_group(w, 128)
    want = R.dequant_token_group(*a) @ R.dequant_token_group(*b).t()
    for recipe in [(1, 1, 128), None]:  # None: inferred from the scale shape
        out = G.fp8_gemm_nt(a, b, recipe=recipe, out_dtype=torch.float32, backend=backend)
        assert calc_diff(out, want) < 1e-6
    assert calc_diff(out, x.double() @ w.double().t()) < 1e-3
    wg = _randn(2, 160, 256, seed=5, scale=0.05)
    bg = quant_per_token_group(wg, 128)
    offs = G.counts_to_offsets(torch.tensor([20, 17], dtype=torch.int32))
    xp, m_idx, _ = G.pad_to_contiguous(x, offs)
    out = G.m_grouped_fp8_gemm_nt_contiguous(quant_per_token_group(xp, 128), bg, m_idx, recipe=(1, 1, 128),
                                            backend=backend)
    ref = R.m_grouped_fp8_gemm_nt_contiguous(quant_per_token_group(xp, 128), bg, m_idx, torch.float32, sb_gran=1)
    assert calc_diff(out, ref) < 1e-5
    with pytest.raises(ValueError, match=r"recipe must be one of"):
        G.fp8_gemm_nt(a, b, recipe=(128, 128, 128), backend=backend)
    with pytest.raises(ValueError, match=r"b scales must be \(2, 2\) \(128x128 block"):
        G.fp8_gemm_nt(a, b, recipe=(1, 128, 128), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_ue8m0_scales_as_input(backend):
    """UE8M0 scales packed four to an int32 (SM100's format, MN-major TMA-aligned) give bitwise the
    result of the same scales in float32."""
    x, w = _randn(45, 640, seed=6), _randn(130, 640, seed=7, scale=0.05)
    a, b = quant_per_token_group(x, 128, ue8m0=True), quant_per_token_group(w, 128, ue8m0=True)
    packed_a = (a[0], G.get_mn_major_tma_aligned_packed_ue8m0_tensor(a[1]))
    packed_b = (b[0], G.pack_ue8m0(b[1]))  # K-major packing is accepted too
    assert packed_a[1].dtype == torch.int32 and packed_a[1].shape == (45, 2)
    want = G.fp8_gemm_nt(a, b, out_dtype=torch.float32, backend=backend)
    got = G.fp8_gemm_nt(packed_a, packed_b, out_dtype=torch.float32, backend=backend)
    assert_bitwise_equal(got, want, "packed vs float32 UE8M0 scales")
    with pytest.raises(ValueError, match=r"a packed UE8M0 scales must be \(45, 2\) int32"):
        G.fp8_gemm_nt((a[0], packed_a[1][:, :1]), packed_b, backend=backend)


def test_packed_ue8m0_layout_bits():
    """The packing is DeepGEMM's (biased exponents, little-endian, 4 per int32) and the layout
    MN-major TMA-aligned; non-powers of two are refused."""
    sf = torch.tensor([[2.0 ** -3, 1.0, 2.0 ** 5, 2.0 ** -126, 2.0 ** 127], [0.5, 2.0, 4.0, 8.0, 16.0],
                       [1.0] * 5], dtype=torch.float32)
    packed = G.get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)
    assert packed.shape == (3, 2) and packed.stride() == (1, 4)  # 3 rows padded to 4 (16 bytes of int32)
    words = packed.contiguous().view(torch.uint8).view(3, 8)
    assert words[0].tolist() == [124, 127, 132, 1, 254, 0, 0, 0]
    deepgemm_formula = (torch.cat([sf, torch.ones(3, 3)], 1).view(torch.int32) >> 23).to(torch.uint8).view(torch.int32)
    assert torch.equal(packed[:, :1].contiguous(), deepgemm_formula[:, :1])
    assert_bitwise_equal(G.unpack_ue8m0(packed, 5), sf, "round trip")
    g3 = torch.stack([sf, sf * 2])
    p3 = G.get_mn_major_tma_aligned_packed_ue8m0_tensor(g3)
    assert p3.stride() == (8, 1, 4) and torch.equal(G.unpack_ue8m0(p3, 5), g3)
    with pytest.raises(ValueError, match="not positive powers of two"):
        G.pack_ue8m0(torch.tensor([[1.5, 2.0]]))


def test_mn_major_tma_aligned_float_layout():
    sf = torch.rand(2, 5, 3, generator=torch.Generator().manual_seed(0))
    out = G.get_mn_major_tma_aligned_tensor(sf)
    assert torch.equal(out, sf) and out.stride() == (24, 1, 8)
    assert G.get_tma_aligned_size(5, 4) == 8 and G.get_tma_aligned_size(5, 1) == 16
    assert DG.to_mn_major_tma_aligned is G.get_mn_major_tma_aligned_tensor  # the earlier name


@pytest.mark.parametrize("arch", [9, 10])
def test_transform_sf_into_required_layout(arch):
    x, w = _randn(6, 384, seed=8), _randn(2, 200, 384, seed=9)
    asf = quant_per_token_group(x, 128, ue8m0=True)[1]
    bsf = quant_per_block(w, ue8m0=True)[1]
    ta = G.transform_sf_into_required_layout(asf, 6, 384, (1, 128, 128), is_sfa=True, arch_major=arch)
    tb = G.transform_sf_into_required_layout(bsf, 200, 384, (1, 128, 128), num_groups=2, arch_major=arch)
    if arch == 9:
        assert ta.dtype == torch.float32 and torch.equal(ta, asf) and ta.stride() == (1, 8)
        assert torch.equal(tb, bsf)  # 128x128 block scales stay as they are on SM90
    else:
        assert ta.dtype == torch.int32 and torch.equal(G.unpack_ue8m0(ta, 3), asf)
        rows = torch.arange(200) // 128  # block scales broadcast to rows, then packed
        assert tb.shape == (2, 200, 1) and torch.equal(G.unpack_ue8m0(tb, 3), bsf[:, rows])
        with pytest.raises(ValueError, match="not positive powers of two"):
            G.transform_sf_into_required_layout(quant_per_token_group(x, 128)[1], 6, 384, (1, 128, 128), is_sfa=True,
                                                arch_major=arch)
        # disable_ue8m0_cast keeps float32 (DeepGEMM's flag)
        assert G.transform_sf_into_required_layout(asf, 6, 384, (1, 128, 128), is_sfa=True, disable_ue8m0_cast=True,
                                                   arch_major=arch).dtype == torch.float32
    with pytest.raises(ValueError, match=r"sf must have shape \(6, 3\)"):
        G.transform_sf_into_required_layout(asf[:, :2], 6, 384, (1, 128, 128), is_sfa=True, arch_major=arch)


# ------------------------------------------------------------------------------ alignment, psum


def test_alignment_getter_setter_and_theoretical(alignment):
    assert G.get_mk_alignment_for_contiguous_layout() == 128 == G.get_m_alignment()
    assert G.get_theoretical_mk_alignment_for_contiguous_layout(arch_major=9) == 128
    assert G.get_theoretical_mk_alignment_for_contiguous_layout(arch_major=10) == 224
    got = {m: G.get_theoretical_mk_alignment_for_contiguous_layout(m, arch_major=10)
           for m in [0, 1, 32, 33, 64, 150, 193, 4096]}
    assert got == {0: 32, 1: 32, 32: 32, 33: 64, 64: 64, 150: 160, 193: 224, 4096: 224}
    G.set_mk_alignment_for_contiguous_layout(64)
    assert G.get_mk_alignment_for_contiguous_layout() == 64
    assert G.align_counts(torch.tensor([1, 64, 65, 0], dtype=torch.int32)).tolist() == [64, 64, 128, 0]
    for bad in (0, -32, 1.5, True):
        with pytest.raises(ValueError, match="alignment must be a positive int"):
            G.set_mk_alignment_for_contiguous_layout(bad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("align", [224, 32])
def test_contiguous_layout_at_any_alignment(backend, align, alignment):
    """pad_to_contiguous(alignment=224) (and the SM100 minimum 32, where a 128-row tile holds
    several groups) builds a layout primerl's contiguous GEMM takes."""
    counts = [37, 0, 130, 5, 1]
    offs = G.counts_to_offsets(torch.tensor(counts, dtype=torch.int32))
    x = _randn(sum(counts), 256, seed=10)
    w = _randn(len(counts), 96, 256, seed=11, scale=0.05)
    xp, m_idx, _ = G.pad_to_contiguous(x, offs, alignment=align)
    assert xp.shape[0] == sum(-(-c // align) * align for c in counts)
    a = _poison_rows(quant_per_token_group(xp, 128), m_idx < 0)
    b = quant_per_block(w)
    out = G.m_grouped_fp8_gemm_nt_contiguous(a, b, m_idx, backend=backend)
    assert bool((out[m_idx < 0] == 0).all()) and not out.isnan().any()
    ref = R.grouped_gemm_nt_m_indices(R.dequant_token_group(*a).nan_to_num(0), R.dequant_block(*b), m_idx,
                                      torch.float32)
    assert calc_diff(out, ref) < 1e-5
    # the setter makes it every helper's default
    G.set_mk_alignment_for_contiguous_layout(align)
    assert torch.equal(G.pad_to_contiguous(x, offs)[1], m_idx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_psum_layout(backend, alignment):
    """DeepGEMM's psum layout (psum[g] = align(psum[g-1]) + m_g) gives the m_indices result bitwise;
    gap rows are written as zero and never read."""
    G.set_mk_alignment_for_contiguous_layout(64)
    counts = [37, 0, 70, 1]
    psum = G.counts_to_psum(torch.tensor(counts, dtype=torch.int32))
    want, prev = [], 0
    for m in counts:  # DeepGEMM's generator formula
        prev = (-(-prev // 64) * 64 if prev else 0) + m
        want.append(prev)
    assert psum.tolist() == want
    offs = G.counts_to_offsets(torch.tensor(counts, dtype=torch.int32))
    xp, m_idx, _ = G.pad_to_contiguous(_randn(sum(counts), 256, seed=12), offs)
    assert torch.equal(G.psum_to_m_indices(psum, xp.shape[0]), m_idx)
    a = _poison_rows(quant_per_token_group(xp, 128), m_idx < 0)
    b = quant_per_block(_randn(len(counts), 128, 256, seed=13, scale=0.05))
    out = G.m_grouped_fp8_gemm_nt_contiguous(a, b, psum, use_psum_layout=True, backend=backend)
    assert_bitwise_equal(out, G.m_grouped_fp8_gemm_nt_contiguous(a, b, m_idx, backend=backend), "psum vs m_indices")
    assert bool((out[m_idx < 0] == 0).all())
    with pytest.raises(ValueError, match="is not a psum layout for alignment 64"):
        G.m_grouped_fp8_gemm_nt_contiguous(a, b, torch.tensor([37, 40, 110, 111], dtype=torch.int32),
                                           use_psum_layout=True, backend=backend)


# ------------------------------------------------------------------------------ masked, k-grouped


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_rows_past_masked_m_are_left_untouched(backend):
    """One behaviour on every backend (DeepGEMM's): rows past masked_m of d are not written."""
    groups, max_m, n, k = 3, 40, 128, 256
    masked_m = torch.tensor([0, 1, 37], dtype=torch.int32)
    past = torch.arange(max_m)[None, :] >= masked_m[:, None]
    a = _poison_rows(quant_per_token_group(_randn(groups, max_m, k, seed=14), 128), past)
    b = quant_per_block(_randn(groups, n, k, seed=15, scale=0.05))
    d = torch.full((groups, max_m, n), NAN, dtype=torch.bfloat16)
    d[1, 5:9] = 7.0  # any content stays
    before = d.clone()
    out = G.m_grouped_fp8_gemm_nt_masked(a, b, masked_m, 16, d, backend=backend)
    assert out is d
    assert_bitwise_equal(d[past], before[past], "rows past masked_m")
    ref = R.dequant_token_group(*a).nan_to_num(0) @ R.dequant_block(*b).transpose(1, 2)
    assert not d[~past].isnan().any() and calc_diff(d[~past], ref[~past]) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_grouped_ks_compact_scales_and_c(backend):
    ks = [128, 0, 256, 128]  # DeepGEMM's per-group sizes (aligned), summing to T
    t, n, k = sum(ks), 96, 128
    dy, x = _randn(t, n, seed=16), _randn(t, k, seed=17)
    offs = G.counts_to_offsets(torch.tensor(ks, dtype=torch.int32))
    a, b = G.quant_per_group_colwise(dy, offs, backend=backend), G.quant_per_group_colwise(x, offs, backend=backend)
    want = G.k_grouped_fp8_gemm_tn_contiguous(a, b, offs, backend=backend)
    ac = G.quant_per_group_colwise(dy, ks=ks, compact=True, backend=backend)
    bc = G.quant_per_group_colwise(x, ks=ks, compact=True, backend=backend)
    assert ac[1].shape == (4, n) and torch.equal(ac[1], a[1][:4])
    assert torch.equal(ac[0].view(torch.uint8), a[0].view(torch.uint8))
    assert_bitwise_equal(G.k_grouped_fp8_gemm_tn_contiguous(ac, bc, ks=ks, backend=backend), want, "ks + compact rows")
    ref = torch.stack([dy[s - c:s].double().t() @ x[s - c:s].double() for s, c in zip(offs.tolist(), ks)])
    assert calc_diff(want, ref) < 1e-3
    c = _randn(4, n, k, seed=18, scale=10.0, dtype=torch.float32)
    d = c.clone()
    out = G.k_grouped_fp8_gemm_tn_contiguous(a, b, offs, d, d, backend=backend)
    assert out is d and calc_diff(out, want + c) < 1e-7
    with pytest.raises(ValueError, match="look like per-group sizes"):
        G.k_grouped_fp8_gemm_tn_contiguous(a, b, torch.tensor(ks, dtype=torch.int32), backend=backend)
    with pytest.raises(ValueError, match="look like per-group sizes"):
        G.quant_per_group_colwise(x, torch.tensor([128, 128, 256], dtype=torch.int32), backend=backend)
    with pytest.raises(ValueError, match="pass exactly one of offsets"):
        G.k_grouped_fp8_gemm_tn_contiguous(a, b, offs, ks=ks, backend=backend)
    with pytest.raises(ValueError, match=r"a scales must be \(8, 96\) .*got \(5, 96\).*need 4 scale rows"):
        G.k_grouped_fp8_gemm_tn_contiguous((a[0], a[1][:5]), b, offs, backend=backend)


def test_colwise_quantizer_is_deepgemm_per_channel_cast():
    """One group of T rows: quant_per_group_colwise is DeepGEMM's per_channel_cast_to_fp8 formula
    (128-row column blocks, ``(x * (1.0 / sf)).to(e4m3)``), bitwise, with and without ue8m0."""
    x = _randn(256, 48, seed=21, dtype=torch.float32) * 3
    view = x.view(-1, 128, 48)
    amax = view.abs().float().amax(dim=1).view(-1, 48).clamp(1e-4)
    for ue8m0 in (False, True):
        sf = amax / 448.0
        if ue8m0:
            bits = sf.view(torch.int32)
            sf = ((((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()).clamp(1, 254) << 23).view(torch.float32)
        q_want = (view * (1.0 / sf.unsqueeze(1))).to(torch.float8_e4m3fn).view(256, 48)
        q, s = G.quant_per_group_colwise(x, ks=[256], ue8m0=ue8m0, compact=True, backend="torch")
        assert_bitwise_equal(s, sf, f"sf ue8m0={ue8m0}")
        assert_bitwise_equal(q, q_want, f"q ue8m0={ue8m0}")


# ------------------------------------------------------------------------------ deep_gemm adapter


def _ue8m0_operands():
    x, w = _randn(8, 256, seed=19), _randn(128, 256, seed=20)
    return quant_per_token_group(x, 128, ue8m0=True), quant_per_block(w, ue8m0=True)


@pytest.mark.parametrize("capability,match", [((8, 0), r"runs on SM90 \(Hopper\) and SM100 \(Blackwell\); cpu is SM80"),
                                              ((12, 0), "is SM120")])
def test_deep_gemm_rejects_other_architectures(monkeypatch, capability, match):
    monkeypatch.setattr(DG, "device_capability", lambda device: capability)
    a, b = _ue8m0_operands()
    with pytest.raises(ValueError, match=match):
        DG.fp8_gemm_nt(a, b, torch.empty(8, 128, dtype=torch.bfloat16), None, (1, 128, 128))


def test_deep_gemm_on_sm100_needs_ue8m0_scales(monkeypatch):
    """float32 scales that are not powers of two would be truncated / trap on SM100: a clear error
    before DeepGEMM is touched; UE8M0 scales pass the check (and then need the real DeepGEMM)."""
    monkeypatch.setattr(DG, "device_capability", lambda device: (10, 0))
    x, w = _randn(8, 256, seed=19), _randn(128, 256, seed=20)
    a, b = quant_per_token_group(x, 128), quant_per_block(w)
    d = torch.empty(8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError,
                       match=r"SM100 .* UE8M0 scales \(powers of two\) only, but a scales holds 16 float32"):
        DG.fp8_gemm_nt(a, b, d, None, (1, 128, 128))
    with pytest.raises(ValueError, match="ue8m0=True"):
        DG.m_grouped_fp8_gemm_nt_masked((a[0][None], a[1][None]), (b[0][None], b[1][None]),
                                        torch.tensor([8], dtype=torch.int32), 8, d[None], (1, 128, 128))
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # not installed: the call gets past the check
    with pytest.raises(ImportError):
        DG.fp8_gemm_nt(*_ue8m0_operands(), d, None, (1, 128, 128))


def test_deep_gemm_sm90_recipe_and_argument_marshalling(monkeypatch):
    """With a recording stand-in for the deep_gemm module (this checks primerl's marshalling only,
    not DeepGEMM): SM90 gets MN-major TMA-aligned float32 A scales, SM100 packed int32, and d / c /
    recipe are passed through; recipe (1, 1, 128) is refused on SM90."""
    calls = []
    fake = types.SimpleNamespace(fp8_gemm_nt=lambda a, b, d, **kw: calls.append((a, b, d, kw)))
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    a, b = _ue8m0_operands()
    d = torch.zeros(8, 128, dtype=torch.float32)
    for arch in (9, 10):
        monkeypatch.setattr(DG, "device_capability", lambda device, arch=arch: (arch, 0))
        DG.fp8_gemm_nt(a, b, d, d, (1, 128, 128))
        (qa, sfa), (qb, sfb), dd, kw = calls[-1]
        assert dd is d and kw["c"] is d and kw["recipe"] == (1, 128, 128)
        if arch == 9:
            assert sfa.dtype == torch.float32 and sfa.stride() == (1, 8) and torch.equal(sfa, a[1])
        else:
            assert sfa.dtype == torch.int32 and torch.equal(G.unpack_ue8m0(sfa, 2), a[1]) and sfb.dtype == torch.int32
    monkeypatch.setattr(DG, "device_capability", lambda device: (9, 0))
    with pytest.raises(ValueError, match=r"recipe \(1, 1, 128\) \(per-row B scales\) needs SM100"):
        DG.fp8_gemm_nt(a, (b[0], quant_per_token_group(b[0].float(), 128)[1]), d, None, (1, 1, 128))


# ------------------------------------------------------------------------------ deep_gemm adapter: k-grouped


def _k_grouped_inputs(ks, n, k, tail=0, seed=50):
    """dY [T, n] and X [T, k] (T = sum(ks) + tail) quantized with UE8M0 scales, static scale rows,
    and the offsets of ks; rows past sum(ks) belong to no group."""
    offs = G.counts_to_offsets(torch.tensor(ks, dtype=torch.int32))
    t = sum(ks) + tail
    dy, x = _randn(t, n, seed=seed), _randn(t, k, seed=seed + 1)
    a = G.quant_per_group_colwise(dy, offs, ue8m0=True, backend="torch")
    b = G.quant_per_group_colwise(x, offs, ue8m0=True, backend="torch")
    return a, b, offs


class _FakeDeepGemm:
    """Stands in for the deep_gemm module: records each k_grouped_fp8_gemm_tn_contiguous call and
    computes what DeepGEMM's contract says the arguments mean (group g owns the next ks[g] rows and
    the next ks[g] / 128 scale rows; with c, d += ...). Empty groups are left unwritten, the worst
    case an adapter must survive."""

    def __init__(self):
        self.calls = []

    def k_grouped_fp8_gemm_tn_contiguous(self, a, b, d, ks, ks_tensor, c=None, recipe=(1, 1, 128), compiled_dims="mn"):
        self.calls.append(dict(a=a, b=b, d=d, ks=ks, ks_tensor=ks_tensor, c=c, recipe=recipe))
        deq_a = a[0].float() * a[1].repeat_interleave(128, dim=0)
        deq_b = b[0].float() * b[1].repeat_interleave(128, dim=0)
        start = 0
        for g, k in enumerate(ks):
            if k:
                prod = deq_a[start:start + k].t() @ deq_b[start:start + k]
                d[g] = prod + (c[g] if c is not None else 0)
            start += k


def test_deep_gemm_k_grouped_argument_marshalling(monkeypatch):
    """With a recording stand-in for deep_gemm (this checks primerl's marshalling only, not DeepGEMM,
    which needs an SM100 GPU): offsets with a tail of rows past the last group and static scale rows
    reach DeepGEMM as ks (host list) + ks_tensor (int32, same values), the first sum(ks) rows of q,
    the compact sum(ks) / 128 float32 scale rows, d itself, c=d after c is copied into d, and recipe
    (1, 1, 128); the stand-in's reading of those arguments matches the torch backend, and an empty
    group it leaves unwritten comes back zero."""
    fake = _FakeDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    monkeypatch.setattr(DG, "device_capability", lambda device: (10, 0))
    from primerl.kernels.gemm import fp8_gemm as F

    monkeypatch.setattr(F, "resolve_backend", lambda op, backend, *args, **kwargs: backend)  # CPU tensors
    ks, n, k = [256, 0, 128, 384], 48, 32
    a, b, offs = _k_grouped_inputs(ks, n, k, tail=37)
    rows = sum(ks) // 128
    assert a[1].shape[0] == G.max_group_blocks(sum(ks) + 37, 4) > rows  # static rows: sliced for DeepGEMM
    want = G.k_grouped_fp8_gemm_tn_contiguous(a, b, offs, backend="torch")

    out = G.k_grouped_fp8_gemm_tn_contiguous(a, b, offs, backend="deep_gemm")
    call = fake.calls[-1]
    assert call["ks"] == ks and isinstance(call["ks"], list) and all(type(v) is int for v in call["ks"])
    assert call["ks_tensor"].dtype == torch.int32 and call["ks_tensor"].tolist() == ks
    for name, pair in (("a", a), ("b", b)):
        q, sf = call[name]
        assert torch.equal(q.view(torch.uint8), pair[0][:sum(ks)].view(torch.uint8)) and q.is_contiguous()
        assert sf.dtype == torch.float32 and sf.is_contiguous() and torch.equal(sf, pair[1][:rows])
    assert call["d"] is out and out.shape == (4, n, k) and out.dtype == torch.float32
    assert call["c"] is None and call["recipe"] == (1, 1, 128)
    assert bool((out[1] == 0).all()) and calc_diff(out, want) < 1e-10

    # ks= and compact rows give the same call; c is copied into d and passed as d
    ac = G.quant_per_group_colwise(_randn(sum(ks), n, seed=50), ks=ks, ue8m0=True, compact=True, backend="torch")
    bc = G.quant_per_group_colwise(_randn(sum(ks), k, seed=51), ks=ks, ue8m0=True, compact=True, backend="torch")
    c = _randn(4, n, k, seed=52, scale=8.0, dtype=torch.float32)
    d = torch.full((4, n, k), NAN)
    out = G.k_grouped_fp8_gemm_tn_contiguous(ac, bc, d=d, c=c, ks=ks, backend="deep_gemm")
    call = fake.calls[-1]
    assert out is d and call["d"] is d and call["c"] is d and call["ks"] == ks
    assert torch.equal(call["a"][1], ac[1]) and call["a"][0].shape == (sum(ks), n)
    want = G.k_grouped_fp8_gemm_tn_contiguous(ac, bc, c=c, ks=ks, backend="torch")
    assert torch.equal(out[1], c[1]) and calc_diff(out, want) < 1e-10

    # the automatic choice never takes deep_gemm for this op
    seen = {}
    monkeypatch.setattr(F, "resolve_backend", lambda op, backend, dev, supported, preference: seen.update(
        supported=supported, preference=preference) or "torch")
    G.k_grouped_fp8_gemm_tn_contiguous(a, b, offs)
    assert "deep_gemm" in seen["supported"] and "deep_gemm" not in seen["preference"]


@pytest.mark.parametrize("capability,match", [
    ((9, 0), r"DeepGEMM has this op on SM100 \(Blackwell\) only; cpu is SM90. Use backend='triton'"),
    ((8, 9), "SM100 .* only; cpu is SM89"),
    ((12, 0), "SM100 .* only; cpu is SM120")])
def test_deep_gemm_k_grouped_rejects_other_architectures(monkeypatch, capability, match):
    """DeepGEMM's k_grouped_fp8_gemm_tn_contiguous dispatches on SM100 only (SM90 included): refused
    before the module is even imported, and d is left as it was."""
    monkeypatch.setattr(DG, "device_capability", lambda device: capability)
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    a, b, _ = _k_grouped_inputs([128, 256], 32, 16)
    d = torch.full((2, 32, 16), NAN)
    with pytest.raises(ValueError, match=match):
        DG.k_grouped_fp8_gemm_tn_contiguous(a, b, [128, 256], d, None)
    assert d.isnan().all()


def test_deep_gemm_k_grouped_refuses_what_deepgemm_cannot_take(monkeypatch):
    """On SM100, before DeepGEMM is called and before d is touched: scales that are not UE8M0, group
    sizes off DeepGEMM's K alignment, e5m2 operands, a bf16 or strided d, more than 128 groups,
    rows that are not 16-byte multiples, too few scale rows."""
    fake = _FakeDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    monkeypatch.setattr(DG, "device_capability", lambda device: (10, 0))
    ks = [128, 256]
    a, b, offs = _k_grouped_inputs(ks, 32, 16)
    c = torch.ones(2, 32, 16)
    d = torch.full((2, 32, 16), NAN)

    def refused(match, a=a, b=b, ks=ks, d=d):
        with pytest.raises(ValueError, match=match):
            DG.k_grouped_fp8_gemm_tn_contiguous(a, b, ks, d, c)
        assert not fake.calls and d.isnan().all()

    not_ue8m0 = G.quant_per_group_colwise(_randn(384, 32, seed=50), offs, backend="torch")
    refused(r"reads UE8M0 scales \(powers of two\) only, but a scales holds \d+ float32 scales .* ue8m0=True",
            a=not_ue8m0)
    refused(r"every group size in ks to be a multiple of 128 .* got ks=\[64, 320\]", ks=[64, 320])
    with monkeypatch.context() as m:
        m.setattr(DG, "get_mk_alignment_for_contiguous_layout", lambda: 256)
        refused(r"multiple of 128 and of get_mk_alignment_for_contiguous_layout\(\)=256")
    refused(r"float8_e4m3fn operands, b\[0\] is torch.float8_e5m2", b=(b[0].to(torch.float8_e5m2), b[1]))
    refused(r"contiguous float32 d .* got torch.bfloat16", d=torch.full((2, 32, 16), NAN, dtype=torch.bfloat16))
    refused(r"contiguous float32 d", d=torch.full((2, 32, 32), NAN)[..., :16])
    refused(r"at most 128 groups, got 129", ks=[128] + [0] * 128)
    a24 = G.quant_per_group_colwise(_randn(384, 24, seed=53), offs, ue8m0=True, backend="torch")
    refused(r"a\[0\] has 24 columns; DeepGEMM's TMA loads need 16-byte rows", a=a24)
    refused(r"a scales have 2 rows, ks=\[128, 256\] need 3", a=(a[0], a[1][:2]))
    DG.k_grouped_fp8_gemm_tn_contiguous(a, b, ks, d, c)  # the same call with nothing wrong gets through
    assert len(fake.calls) == 1 and fake.calls[0]["c"] is d


@pytest.mark.gpu
def test_gpu_deepgemm_k_grouped_against_torch(alignment):
    """The real DeepGEMM k_grouped_fp8_gemm_tn_contiguous (SM100 with DeepGEMM v2 installed) against
    the torch backend on the same UE8M0 operands: calc_diff < 1e-5, with and without c, an empty
    group and rows past the last group."""
    dg = pytest.importorskip("deep_gemm", reason="DeepGEMM is not installed (built from source by the user)")
    if not hasattr(dg, "k_grouped_fp8_gemm_tn_contiguous"):
        pytest.skip("this deep_gemm has no k_grouped_fp8_gemm_tn_contiguous (DeepGEMM v2 API)")
    if torch.cuda.get_device_capability()[0] != 10:
        pytest.skip("DeepGEMM's k_grouped_fp8_gemm_tn_contiguous runs on SM100 only")
    dev = "cuda"
    G.set_mk_alignment_for_contiguous_layout(128)
    restore = None
    if hasattr(dg, "set_mk_alignment_for_contiguous_layout"):
        restore = dg.get_mk_alignment_for_contiguous_layout()
        dg.set_mk_alignment_for_contiguous_layout(128)
    try:
        ks, n, k = [256, 0, 384, 128, 1024], 384, 512
        offs = G.counts_to_offsets(torch.tensor(ks, dtype=torch.int32)).to(dev)
        t = sum(ks) + 40
        dy, x = _randn(t, n, seed=60).to(dev), _randn(t, k, seed=61).to(dev)
        a = G.quant_per_group_colwise(dy, offs, ue8m0=True)
        b = G.quant_per_group_colwise(x, offs, ue8m0=True)
        want = G.k_grouped_fp8_gemm_tn_contiguous(a, b, offs, backend="torch")
        got = G.k_grouped_fp8_gemm_tn_contiguous(a, b, offs, backend="deep_gemm")
        assert bool((got[1] == 0).all()) and calc_diff(got, want) < 1e-5
        c = _randn(len(ks), n, k, seed=62, scale=4.0, dtype=torch.float32).to(dev)
        d = c.clone()
        got = G.k_grouped_fp8_gemm_tn_contiguous(a, b, d=d, c=d, ks=ks, backend="deep_gemm")
        assert got is d and calc_diff(got, want + c) < 1e-5
        got = G.k_grouped_fp8_gemm_tn_contiguous(a, b, c=c, ks=ks, backend="deep_gemm")
        assert torch.equal(got[1], c[1]) and calc_diff(got, want + c) < 1e-5
    finally:
        if restore is not None:
            dg.set_mk_alignment_for_contiguous_layout(restore)


@pytest.mark.gpu
def test_gpu_triton_deepgemm_arguments(alignment):
    """The compiled Triton kernels on the GPU: accumulator c, per-row B scales, a 32-row alignment
    (several groups per tile), psum, and masked rows left untouched, against the torch backend."""
    dev = "cuda"
    x, w = _randn(300, 512, seed=30).to(dev), _randn(384, 512, seed=31, scale=0.05).to(dev)
    a = quant_per_token_group(x, 128)
    for b in (quant_per_block(w), quant_per_token_group(w, 128)):
        c = _randn(300, 384, seed=32, dtype=torch.float32).to(dev)
        got = G.fp8_gemm_nt(a, b, c=c, out_dtype=torch.float32, backend="triton")
        assert calc_diff(got, G.fp8_gemm_nt(a, b, c=c, out_dtype=torch.float32, backend="torch")) < 1e-6
    G.set_mk_alignment_for_contiguous_layout(32)
    counts = torch.tensor([37, 0, 130, 5, 1, 64], dtype=torch.int32)
    offs = G.counts_to_offsets(counts).to(dev)
    xs = _randn(int(counts.sum()), 512, seed=33).to(dev)
    wg = quant_per_block(_randn(6, 256, 512, seed=34, scale=0.05).to(dev))
    xp, m_idx, _ = G.pad_to_contiguous(xs, offs)
    ap = quant_per_token_group(xp, 128)
    ref = G.m_grouped_fp8_gemm_nt_contiguous(ap, wg, m_idx, backend="torch")
    assert calc_diff(G.m_grouped_fp8_gemm_nt_contiguous(ap, wg, m_idx, backend="triton"), ref) < 1e-5
    psum = G.counts_to_psum(counts).to(dev)
    got = G.m_grouped_fp8_gemm_nt_contiguous(ap, wg, psum, use_psum_layout=True, backend="triton")
    assert calc_diff(got, ref) < 1e-5
    masked_m = torch.tensor([0, 3, 40], dtype=torch.int32, device=dev)
    am = quant_per_token_group(_randn(3, 64, 512, seed=35).to(dev), 128)
    d = torch.full((3, 64, 256), NAN, dtype=torch.bfloat16, device=dev)
    G.m_grouped_fp8_gemm_nt_masked(am, (wg[0][:3], wg[1][:3]), masked_m, 16, d, backend="triton")
    past = torch.arange(64, device=dev)[None, :] >= masked_m[:, None]
    assert d[past].isnan().all() and not d[~past].isnan().any()


def test_triton_layout_alignment_mismatch_is_loud(monkeypatch):
    """On a GPU the Triton launch takes the group alignment from the setter (no host sync): a
    layout built with a smaller alignment than configured gives NaN rows, never silent zeros.
    Forced here by telling the launcher the tiles hold one group each."""
    from primerl.kernels.gemm import triton as T

    monkeypatch.setattr(T, "_tiles_mix_groups", lambda m_indices, bm: False)
    offs = G.counts_to_offsets(torch.tensor([20, 100], dtype=torch.int32))
    xp, m_idx, _ = G.pad_to_contiguous(_randn(120, 256, seed=40), offs, alignment=32)  # groups at rows 0, 32
    b = quant_per_block(_randn(2, 64, 256, seed=41, scale=0.05))
    out = G.m_grouped_fp8_gemm_nt_contiguous(quant_per_token_group(xp, 128), b, m_idx, backend="triton")
    assert out[:20].isnan().all() and out[32:132].isfinite().all()  # a 128-row tile: group 0 is foreign
