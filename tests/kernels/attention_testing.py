"""Helpers shared by the attention tests: packed inputs, a run with gradients, the reference at a
given dtype (flash-attention's error rule compares against it), and a finite-aware max error."""

from __future__ import annotations

import torch

from primerl.kernels.attention import attention, reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)


def inputs(lens, hq, hkv, d, dtype, seed, tk=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(lens)
    tk = t if tk is None else tk
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    return mk(t, hq, d), mk(tk, hkv, d), mk(tk, hkv, d), mk(t, hq, d), torch.randn(hq, t, generator=g).to(DEV)


def run(backend, q, k, v, dout, dlse, **kw):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention(qq, kk, vv, return_lse=True, backend=backend, **kw)
    torch.autograd.backward((out, lse), (dout, dlse))
    return out, lse, qq.grad, kk.grad, vv.grad


def reference_at(dtype, q, k, v, dout, dlse, cu, causal):
    """The same math done by PyTorch at ``dtype`` (inputs cast to it)."""
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    qp, kp = reference.default_positions(cu, cu)
    scale = q.shape[-1] ** -0.5
    out, lse = reference.attention_forward(q, k, v, cu, cu, causal, scale, qp, kp, compute_dtype=dtype)
    dq, dk, dv = reference.attention_backward(dout, q, k, v, out, lse, dlse, cu, cu, causal, scale, qp, kp,
                                              compute_dtype=dtype)
    return out, lse, dq, dk, dv


def max_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a)), "non-finite pattern differs (e.g. lse = -inf rows)"
    return float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0


def assert_within_twice_torch(got, q, k, v, dout, dlse, cu, causal, dtype, tag):
    """flash-attention's error rule for (out, lse, dq, dk, dv): each within twice the error of the
    same math done by PyTorch at ``dtype``, against the float32 reference (plus a tiny floor)."""
    ref32 = reference_at(torch.float32, q, k, v, dout, dlse, cu, causal)
    lowp = reference_at(dtype, q, k, v, dout, dlse, cu, causal)
    for name, g, r, lp in zip(["out", "lse", "dq", "dk", "dv"], got, ref32, lowp):
        floor = 1e-5 * (1 + float(r[torch.isfinite(r)].abs().max()))
        err, torch_err = max_err(g, r), max_err(lp, r)
        assert err <= 2 * torch_err + floor, \
            f"{tag} {name}: err {err:.3e} > 2 x torch@{dtype} err {torch_err:.3e} + {floor:.1e}"
    return ref32
