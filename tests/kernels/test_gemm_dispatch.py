"""The GEMM backend dispatcher (:mod:`primerl.kernels.gemm.dispatch`): which module runs each
resolved backend, an unknown name refused, and the validation module holding checks only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from primerl.kernels import _opaque
from primerl.kernels import gemm as G
from primerl.kernels.gemm import dispatch, reference


def test_each_backend_runs_its_module():
    assert dispatch.backend_module("torch") is reference
    pytest.importorskip("triton")
    from primerl.kernels.gemm import triton, triton_ops

    assert dispatch.backend_module("triton") is triton_ops  # the launchers as custom ops (traceable)
    with _opaque.direct_triton_launches():  # AOT capture: the raw launchers
        assert dispatch.backend_module("triton") is triton


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="no backend module for 'cublas'"):
        dispatch.backend_module("cublas")  # fp8_gemm_nt runs cuBLAS itself, never through the dispatcher


def test_the_public_ops_resolve_against_the_dispatchers_lists():
    assert set(dispatch.PLAIN_BACKENDS) < set(dispatch.FP8_BACKENDS)
    with pytest.raises(ValueError, match="deep_gemm"):  # a bf16 op has no DeepGEMM backend
        G.gemm_nt(torch.randn(2, 8), torch.randn(3, 8), backend="deep_gemm")


def test_checks_module_holds_checks_only():
    """``gemm/_checks.py`` defines validation functions and the dtype lists they check against:
    no backend choice, no import of a backend module."""
    tree = ast.parse((Path(G.__file__).parent / "_checks.py").read_text())
    funcs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert funcs and all(f.startswith("_check") or f == "_shape" for f in funcs), funcs
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "_value_checks", "layout"}, imported
