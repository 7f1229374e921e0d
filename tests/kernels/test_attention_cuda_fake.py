"""The CUDA-only attention backends ("varlen_flash": aten._flash_attention_forward/_backward; "cudnn":
aten._scaled_dot_product_cudnn_attention) run on storage-less stand-ins for CUDA tensors (meta
tensors that report cuda: primerl.kernels.aot's _MetaAsCuda; FakeTensorMode makes cuda fakes on this
CPU build but their views raise "PyTorch is not linked with support for cuda devices"), with the
device capability check patched (no CUDA runtime answers it): output shapes and dtypes, and no host
read beyond what each needs. A host read of a meta tensor raises, so a pass proves none happened.

- varlen_flash with ``max_seqlen`` given: no read at all, forward and backward (incl. a gradient
  through lse).
- cudnn cuts the batch into runs of equal-length sequences, one dense call each: it needs the
  offsets' values on the host (read once per tensor in eager, ``attention.spec._host_values``); given
  them, the rest of its forward and backward reads nothing.
"""

from __future__ import annotations

import pytest
import torch

from primerl.kernels.aot import _MetaAsCuda

from primerl.kernels import debug_checks
from primerl.kernels.attention import AttentionSpec, attention, cudnn, varlen_flash

pytestmark = pytest.mark.no_poison

LENS = (5, 0, 11)


@pytest.fixture
def fake_cuda(monkeypatch):
    for mod in (varlen_flash, cudnn):
        monkeypatch.setattr(mod, "_static_reason", lambda device, dtype, head_dim, *a: None)
    with _MetaAsCuda():
        yield


def _leaves(T, dtype=torch.bfloat16):
    mk = lambda *s: torch.empty(*s, device="cuda", dtype=dtype).requires_grad_()  # noqa: E731
    return mk(T, 8, 64), mk(T, 2, 64), mk(T, 2, 64)


def test_varlen_flash_forward_backward_on_fake_cuda(fake_cuda):
    T = sum(LENS)
    q, k, v = _leaves(T)
    cu = torch.empty(len(LENS) + 1, dtype=torch.int32, device="cuda")
    with debug_checks(False):  # debug mode reads the offsets to check them (its purpose)
        out, lse = attention(q, k, v, cu_seqlens=cu, return_lse=True, backend="varlen_flash", max_seqlen=max(LENS))
        assert (out.shape, out.dtype, out.device.type) == ((T, 8, 64), torch.bfloat16, "cuda")
        assert (lse.shape, lse.dtype) == ((8, T), torch.float32)
        grads = torch.autograd.grad((out.float().sum() + lse.sum()), (q, k, v))
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype


def test_varlen_flash_without_max_seqlen_reads_the_offsets(fake_cuda):
    q, k, v = _leaves(sum(LENS))
    cu = torch.empty(len(LENS) + 1, dtype=torch.int32, device="cuda")
    with debug_checks(False), pytest.raises(Exception, match="Cannot copy out of meta tensor"):
        attention(q, k, v, cu_seqlens=cu, backend="varlen_flash")


def test_cudnn_forward_backward_given_host_offsets(fake_cuda):
    T = sum(LENS)
    q, k, v = (t.detach() for t in _leaves(T))
    cu = torch.empty(len(LENS) + 1, dtype=torch.int32, device="cuda")
    host = (0, 5, 5, 16)
    spec = AttentionSpec(cu, cu, True, 0.125, None, None, 11, 11, host, host, T, T)
    assert cudnn.runs(spec) == [(0, 0, 1, 5, 5), (5, 5, 1, 11, 11)]
    out, lse = cudnn.forward(q, k, v, spec, torch.bfloat16)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((T, 8, 64), torch.bfloat16, (8, T), torch.float32)
    dq, dk, dv = cudnn.backward(torch.empty_like(out), q, k, v, out, lse, None, spec)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
