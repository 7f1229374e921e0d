"""The "sdpa" attention backend (torch's fused SDPA kernels over runs of equal-length sequences)
against the float32 reference, with flash-attention's error rule: its error vs the float32
reference is at most twice the error of the same math done by PyTorch at the input dtype (plus a
tiny floor), for out, lse, dq, dk, dv (gradients through lse included)."""

from __future__ import annotations

import pytest
import torch

from primerl.kernels._backend import resolve_backend
from primerl.kernels.attention import attention, attention_backward, attention_forward, merge_attn_states, reference

from attention_testing import cu as _cu, inputs as _inputs, max_err as _max_err, run as _run, \
    assert_within_twice_torch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


LENS = {
    "one": [37],
    "ragged": [1, 5, 17, 1, 9],
    "with_empty": [3, 0, 1, 12],
    "equal_runs": [8, 8, 8, 1, 1, 13, 13],  # runs of equal lengths go to one kernel call each
    "all_ones": [1, 1, 1, 1],
}


@pytest.mark.parametrize(
    "dtype,lens,hq,hkv,d,causal",
    [
        (torch.bfloat16, "ragged", 4, 2, 32, True),
        (torch.bfloat16, "one", 2, 2, 64, False),
        (torch.float16, "with_empty", 3, 1, 16, True),
        (torch.float32, "ragged", 2, 1, 24, True),
        (torch.bfloat16, "with_empty", 2, 1, 128, False),
        (torch.bfloat16, "equal_runs", 4, 1, 64, True),
        (torch.float32, "equal_runs", 4, 2, 32, False),
        (torch.bfloat16, "all_ones", 2, 2, 16, True),
    ],
)
def test_error_within_twice_torch_at_input_dtype(dtype, lens, hq, hkv, d, causal):
    lens = LENS[lens]
    q, k, v, dout, dlse = _inputs(lens, hq, hkv, d, dtype, seed=sum(lens) * 11 + d + hq + len(str(dtype)))
    cu = _cu(lens)
    got = _run("sdpa", q, k, v, dout, dlse, cu_seqlens=cu, causal=causal)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32 and got[1].shape == (hq, sum(lens))
    assert_within_twice_torch(got, q, k, v, dout, dlse, cu, causal, dtype, "sdpa")


def test_lse_gradient_is_the_extra_term():
    """Only a gradient through lse: sdpa's augmented-head trick equals the reference's dlse term."""
    lens = [6, 1, 10]
    q, k, v, _, dlse = _inputs(lens, 4, 2, 16, torch.float32, seed=21)
    cu = _cu(lens)
    zero = torch.zeros_like(q)
    got, ref = (_run(be, q, k, v, zero, dlse, cu_seqlens=cu) for be in ("sdpa", "torch"))
    assert float(got[2].abs().max()) > 1e-3  # the term is not trivially zero
    for name, a, b in zip(["dq", "dk", "dv"], got[2:], ref[2:]):
        assert _max_err(a, b) < 2e-5, name


def test_non_square_with_positions_matches_reference():
    """A ring step: explicit positions, masked (-1) keys, non-square causal blocks, rows that see
    no key (out 0, lse -inf and zero gradient)."""
    lq, lk = [20, 3, 34], [34, 5, 20]
    q, k, v, dout, dlse = _inputs(lq, 4, 2, 16, torch.float32, seed=5, tk=sum(lk))
    cu_q, cu_k = _cu(lq), _cu(lk)
    g = torch.Generator().manual_seed(6)
    q_pos = torch.randint(0, 40, (sum(lq),), generator=g).int().to(DEV)
    q_pos[:20] = torch.arange(30, 50)
    k_pos = torch.cat([torch.arange(34), torch.arange(10, 15), torch.arange(60, 80)]).int().to(DEV)
    k_pos[torch.randperm(sum(lk), generator=g)[:6].to(DEV)] = -1
    for causal in (True, False):
        kw = dict(cu_seqlens=cu_q, cu_seqlens_k=cu_k, q_positions=q_pos, k_positions=k_pos, causal=causal)
        got, ref = (_run(be, q, k, v, dout, dlse, **kw) for be in ("sdpa", "torch"))
        if causal:
            assert torch.isinf(got[1][:, -34:]).all() and (got[0][-34:] == 0).all()
        for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, ref):
            assert _max_err(a, b) < 2e-5, f"{name} causal={causal}"
    # default positions, non-square causal (bottom-right aligned, as flash-attn): needs a mask too
    got, ref = (_run(be, q, k, v, dout, dlse, cu_seqlens=cu_q, cu_seqlens_k=cu_k) for be in ("sdpa", "torch"))
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, ref):
        assert _max_err(a, b) < 2e-5, f"{name} bottom-right"


def test_masked_runs_in_row_blocks_match_reference(monkeypatch):
    """A masked run goes to the kernel in blocks of query rows (its mask stays O(rows x Lk) for
    long ring shards): with blocks of 7 rows, the same results as the reference."""
    from primerl.kernels.attention import sdpa

    monkeypatch.setattr(sdpa, "MASK_ELEMENTS", 7 * 34)
    assert len(sdpa._row_blocks(34, 34, True)) == 5 and sdpa._row_blocks(34, 34, False) == [(0, 34)]
    test_non_square_with_positions_matches_reference()


def test_block_backward_sums_to_full_gradient():
    """Ring use: forward per key half, merge, block backward with the merged out/lse."""
    lens = [13, 1, 18]
    q, k, v, dout, _ = _inputs(lens, 2, 1, 32, torch.float32, seed=7)
    cu = _cu(lens)
    qp, kp = reference.default_positions(cu, cu)
    half = kp % 2 == 0
    kw = dict(cu_seqlens=cu, q_positions=qp, backend="sdpa")
    parts = [torch.where(half, kp, -1), torch.where(half, -1, kp)]
    (oa, la), (ob, lb) = (attention_forward(q, k, v, k_positions=p, out_dtype=torch.float32, **kw) for p in parts)
    out, lse = merge_attn_states(oa, la, ob, lb)
    full = _run("torch", q, k, v, dout, torch.zeros_like(la), cu_seqlens=cu)
    assert _max_err(out, full[0]) < 1e-5 and _max_err(lse, full[1]) < 1e-5
    grads = [attention_backward(dout, q, k, v, out, lse, k_positions=p, **kw) for p in parts]
    for i, name in enumerate(["dq", "dk", "dv"]):
        assert grads[0][i].dtype == torch.float32
        assert _max_err(grads[0][i] + grads[1][i], full[2 + i]) < 1e-5, name


def test_named_only_default_unchanged():
    assert resolve_backend("attention", None, torch.device("cpu"), supported=("torch", "triton", "flash_attn", "sdpa"),
                           preference=("triton", "torch")) == "torch"
    assert resolve_backend("attention", "sdpa", torch.device("cpu"), supported=("sdpa",)) == "sdpa"
    q, k, v, *_ = _inputs([4], 2, 2, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="not implemented"):
        attention(q, k, v, backend="sdpa_typo")


@pytest.mark.parametrize("causal", [True, False])
def test_sequences_without_queries_or_keys(causal):
    """Gaps between the kernel runs: queries with no keys (out 0, lse -inf) and keys with no
    queries (zero dk, dv), next to ordinary sequences."""
    lq, lk = [5, 0, 4, 3], [0, 6, 3, 3]
    q, k, v, dout, dlse = _inputs(lq, 2, 1, 16, torch.float32, seed=31, tk=sum(lk))
    kw = dict(cu_seqlens=_cu(lq), cu_seqlens_k=_cu(lk), causal=causal)
    got, ref = (_run(be, q, k, v, dout, dlse, **kw) for be in ("sdpa", "torch"))
    assert torch.isneginf(got[1][:, :5]).all() and (got[0][:5] == 0).all()
    assert (got[3][:6] == 0).all() and (got[4][:6] == 0).all()
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, ref):
        assert _max_err(a, b) < 2e-5, name
