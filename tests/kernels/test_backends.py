"""Backend selection: what is listed, what None picks, and that a named backend never falls back."""

from __future__ import annotations

import pytest
import torch

from primerl.kernels import (
    HAS_CUDA_EXT,
    BackendStatus,
    BackendUnavailableError,
    backend_status,
    backends,
    fp8,
    resolve_backend,
    triton_interpreter_enabled,
)

CPU = torch.device("cpu")
NO_CUDA_BACKEND = not (HAS_CUDA_EXT and torch.cuda.is_available())


def test_backends_lists_every_backend_with_a_reason():
    table = backends()
    assert list(table) == ["torch", "triton", "cuda", "deep_gemm", "flash_attn", "sdpa"]
    for name, status in table.items():
        assert isinstance(status, BackendStatus)
        assert isinstance(status.available, bool)
        assert len(status.reason) > 10, f"{name}: the reason must say something"
    assert table["torch"].available and torch.__version__ in table["torch"].reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only expectations")
def test_cpu_machine_reasons_name_what_is_missing():
    table = backends()
    assert not table["cuda"].available
    assert "primerl._C" in table["cuda"].reason
    for name in ("deep_gemm", "flash_attn"):
        assert not table[name].available
        assert name in table[name].reason
    if triton_interpreter_enabled():
        assert table["triton"].available and "TRITON_INTERPRET=1" in table["triton"].reason


def test_none_on_cpu_picks_the_reference(monkeypatch):
    assert resolve_backend("op", None, CPU) == "torch"
    assert resolve_backend("op", None, CPU, supported=("triton", "torch")) == "torch"
    from primerl.kernels.fp8 import reference

    calls = []
    real = reference.quant_rowwise
    monkeypatch.setattr(reference, "quant_rowwise", lambda *a: calls.append(1) or real(*a))
    fp8.quant_rowwise(torch.randn(3, 8))
    assert calls == [1]


@pytest.mark.skipif(not NO_CUDA_BACKEND, reason="the cuda backend is available here")
def test_named_cuda_backend_raises_naming_the_missing_extension():
    with pytest.raises(BackendUnavailableError, match=r"primerl\._C"):
        resolve_backend("quant_per_token_group", "cuda", CPU)
    with pytest.raises(BackendUnavailableError, match=r"quant_rowwise: backend 'cuda' is unavailable"):
        fp8.quant_rowwise(torch.randn(2, 4), backend="cuda")


def test_cuda_backend_needs_cuda_tensors(monkeypatch):
    import primerl.kernels._backend as backend_mod

    monkeypatch.setattr(backend_mod, "_cuda_status", lambda: BackendStatus(True, "pretend it is built"))
    with pytest.raises(BackendUnavailableError, match="needs CUDA tensors, got cpu"):
        resolve_backend("op", "cuda", CPU)


def test_unknown_and_unsupported_backends_are_value_errors():
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'"):
        backend_status("tpu")
    with pytest.raises(ValueError, match=r"backend 'tpu' is not implemented"):
        resolve_backend("op", "tpu", CPU)
    with pytest.raises(ValueError, match=r"backend 'deep_gemm' is not implemented"):
        fp8.quant_per_token_group(torch.randn(2, 128), backend="deep_gemm")


@pytest.mark.skipif(not triton_interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
def test_triton_on_cpu_runs_under_the_interpreter():
    assert resolve_backend("op", "triton", CPU) == "triton"


@pytest.mark.skipif(triton_interpreter_enabled() or torch.cuda.is_available(), reason="interpreter on or GPU present")
def test_triton_on_cpu_without_interpreter_is_refused():
    with pytest.raises(BackendUnavailableError):
        resolve_backend("op", "triton", CPU)


@pytest.mark.gpu
def test_none_on_cuda_picks_the_fastest_available():
    want = "cuda" if HAS_CUDA_EXT else "triton"
    assert resolve_backend("op", None, torch.device("cuda")) == want
    assert resolve_backend("op", None, torch.device("cuda"), supported=("torch",)) == "torch"
