"""The CUDA-extension ops (csrc/: ``torch.ops.primerl.fp8_quant_*`` / ``moe_*``) and the GPU-library
backends (DeepGEMM, cuBLAS ``F.scaled_mm``, flash-attn) under torch.compile and FakeTensorMode.

This CPU build of torch makes fake CUDA tensors (``FakeTensorMode``, ``device="cuda"``) and traces
ops on them, except where a kernel takes a CUDA device guard (autograd leaves abort the process;
``copy_``, ``contiguous()`` of a strided tensor raise "not linked with support for cuda devices").
So, on this CPU:

- every csrc op's fake kernel: output shapes and dtypes on fake CUDA and on meta tensors equal the
  torch reference's on CPU tensors;
- the public ops with ``backend="cuda"`` / ``"deep_gemm"``, compiled (fullgraph; aot_eager and a
  recording backend) on fake CUDA inputs: one graph node per kernel call, forward only (no autograd
  on fake CUDA). Only the availability checks are patched (nothing runs but fake kernels);
- the DeepGEMM custom ops' registration (opcheck) with a stand-in ``deep_gemm`` module that writes
  d (marshalling only, not DeepGEMM);
- cuBLAS: the probe is a compile-time constant, the call traces on meta tensors without a host read;
- flash-attn: with a stand-in module, ``attention(max_seqlen=...)`` reads nothing on the host and
  compiles fullgraph;
- the extension's registration: csrc/*/..._binding.cpp compiled for the CPU (launchers stubbed) and
  loaded beside the Python schemas: its CUDA kernels are the active ones, a schema mismatch is loud.

The real kernels are checked by the ``gpu`` tests at the end (opcheck, compiled vs eager bitwise).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensorMode

import primerl.kernels as K
from primerl.kernels import _backend, _ext
from primerl.kernels import fp8 as F8
from primerl.kernels import gemm as G
from primerl.kernels import moe as M
from primerl.kernels.gemm import cublas as CB
from primerl.kernels.gemm import deep_gemm as DG
from primerl.kernels.gemm import fp8_gemm as FG
from primerl.kernels.moe import reference as MR
from primerl.kernels.testing import calc_diff, count_host_reads

REPO = Path(__file__).resolve().parents[2]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # a clean torch.compile state per test (tests/conftest.py)


class _Graphs:
    """A torch.compile backend that keeps each graph and runs it as traced."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm

    def primerl_calls(self) -> dict[str, int]:
        calls: dict[str, int] = {}
        for gm in self.graphs:
            for node in gm.graph.nodes:
                name = str(node.target)
                if node.op == "call_function" and "primerl." in name:
                    op = name.split("primerl.")[1].split(".")[0]
                    calls[op] = calls.get(op, 0) + 1
        return calls


def _sig(outs) -> list:
    outs = [outs] if isinstance(outs, torch.Tensor) else outs
    return [(tuple(t.shape), t.dtype) for t in outs]


def _fake_like(mode, t: torch.Tensor, device="cuda") -> torch.Tensor:
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


# ------------------------------------------------------------------------------ csrc ops: schemas and fakes


def test_csrc_ops_exist_without_the_extension():
    """Every op csrc/ implements has its Python schema and a Meta (fake) kernel, and a CUDA kernel:
    the extension's, or (not built, as here) one that raises naming the extension."""
    assert set(_ext.CSRC_OPS) == {"fp8_quant_per_token_group", "fp8_quant_per_block", "fp8_quant_rowwise",
                                  "fp8_quant_tensorwise", "moe_align", "moe_scatter_rows"}
    for name, schema in _ext.CSRC_OPS.items():
        op = getattr(torch.ops.primerl, name).default
        assert str(op._schema) == f"primerl::{name}{schema}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"primerl::{name}", "Meta")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"primerl::{name}", "CUDA")
    if not _ext.HAS_CUDA_EXT:
        with pytest.raises(RuntimeError, match=r"fp8_quant_rowwise on CUDA tensors needs the CUDA extension primerl"):
            _ext._not_built("fp8_quant_rowwise")(torch.ones(2))


def _fp8_cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    cases = []
    for dtype in (E4M3, E5M2):
        for x in (r(3, 256), r(2, 5, 128)):
            cases.append(("fp8_quant_per_token_group", (x, 128, dtype, False, True),
                          lambda x, dtype=dtype: F8.quant_per_token_group(x, 128, dtype=dtype, backend="torch")))
            cases.append(("fp8_quant_rowwise", (x, dtype, False),
                          lambda x, dtype=dtype: F8.quant_rowwise(x, dtype=dtype, backend="torch")))
            cases.append(("fp8_quant_tensorwise", (x, dtype, False),
                          lambda x, dtype=dtype: F8.quant_tensorwise(x, dtype=dtype, backend="torch")))
        for w in (r(130, 131), r(2, 257, 128)):
            cases.append(("fp8_quant_per_block", (w, 128, 128, dtype, True, True),
                          lambda w, dtype=dtype: F8.quant_per_block(w, dtype=dtype, ue8m0=True, backend="torch")))
    return cases


def _moe_cases():
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(7)]).to(torch.int32)
    src = torch.randn(7, 16, generator=g)
    row_map = torch.randperm(14, generator=g).view(7, 2).to(torch.int32)
    scale = torch.rand(7, 2, generator=g)
    return [
        ("moe_align", (ids, 5, 1), lambda i: MR.align(i, 5, 1)),
        ("moe_align", (ids, 5, 4), lambda i: MR.align(i, 5, 4)),
        ("moe_scatter_rows", (src, row_map, None, 14), lambda s, rm: MR.scatter_rows(s, rm, None, 14)),
        ("moe_scatter_rows", (src, row_map, scale, 20), lambda s, rm, sc: MR.scatter_rows(s, rm, sc, 20)),
    ]


FAKE_CASES = _fp8_cases() + _moe_cases()


@pytest.mark.parametrize("name,args,ref", FAKE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(FAKE_CASES)])
def test_csrc_fake_kernels_give_the_reference_shapes(name, args, ref):
    """The op on fake CUDA tensors and on meta tensors: the shapes and dtypes of the torch reference
    on CPU tensors (which the CUDA kernels match bitwise in the gpu tests)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    want = _sig(ref(*tensors))
    op = getattr(torch.ops.primerl, name)
    mode = FakeTensorMode()
    fake_args = [_fake_like(mode, a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        out = op(*fake_args)
    out = [out] if isinstance(out, torch.Tensor) else out
    assert _sig(out) == want and all(t.device.type == "cuda" for t in out)
    assert _sig(op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])) == want


def test_csrc_fake_kernels_check_shapes():
    """The fake kernels refuse what the CUDA kernels refuse (so a traced program fails where eager would)."""
    with pytest.raises(RuntimeError, match="K=100 must be divisible by group_size=128"):
        torch.ops.primerl.fp8_quant_per_token_group(torch.empty(2, 100, device="meta"), 128, E4M3, False, True)
    with pytest.raises(RuntimeError, match=r"w must be \[N, K\] or \[G, N, K\]"):
        torch.ops.primerl.fp8_quant_per_block(torch.empty(4, device="meta"), 128, 128, E4M3, False, True)
    with pytest.raises(RuntimeError, match="row_map must be int32"):
        torch.ops.primerl.moe_scatter_rows(torch.empty(3, 8, device="meta"),
                                           torch.empty(3, 2, dtype=torch.int64, device="meta"), None, 6)


@pytest.fixture
def cuda_backend_available(monkeypatch):
    """Tells resolve_backend that primerl._C and a device are there: for tracing with fake CUDA
    tensors only (nothing but fake kernels runs)."""
    monkeypatch.setattr(_backend, "_cuda_status", lambda: _backend.BackendStatus(True, "traced with fake CUDA"))


@pytest.mark.no_poison
def test_public_cuda_backend_ops_compile_fullgraph_one_node_per_kernel(cuda_backend_available):
    """fp8 quantizers, expert_counts, moe_align and permute with backend="cuda", compiled with
    fullgraph (aot_eager, and a backend that keeps the graph) on fake CUDA inputs: the reference's
    shapes, and each CUDA kernel call is one ``primerl::`` node."""
    E = 8

    def fn(x, w, ids):
        return (*F8.quant_per_token_group(x, 128, backend="cuda"), *F8.quant_per_block(w, backend="cuda"),
                *F8.quant_rowwise(x, backend="cuda"), *F8.quant_tensorwise(x, backend="cuda"),
                M.expert_counts(ids, E, backend="cuda"), *M.moe_align(ids, E, 16, backend="cuda"),
                *M.permute(x, ids, E, backend="cuda"))

    def ref(x, w, ids):
        return (*F8.quant_per_token_group(x, 128), *F8.quant_per_block(w), *F8.quant_rowwise(x),
                *F8.quant_tensorwise(x), M.expert_counts(ids, E), *M.moe_align(ids, E, 16), *M.permute(x, ids, E))

    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(3, 130, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(6)]).to(torch.int32)
    want = _sig(ref(x, w, ids))
    mode = FakeTensorMode()
    fx, fw, fids = (_fake_like(mode, t) for t in (x, w, ids))
    graphs = _Graphs()
    with mode, K.debug_checks(False):
        assert _sig(fn(fx, fw, fids)) == want
        assert _sig(torch.compile(fn, backend=graphs, fullgraph=True)(fx, fw, fids)) == want
        torch._dynamo.reset()
        assert _sig(torch.compile(fn, backend="aot_eager", fullgraph=True)(fx, fw, fids)) == want
    assert graphs.primerl_calls() == {"fp8_quant_per_token_group": 1, "fp8_quant_per_block": 1, "fp8_quant_rowwise": 1,
                                      "fp8_quant_tensorwise": 1, "moe_align": 3, "moe_scatter_rows": 1}


# ------------------------------------------------------------------------------ the extension's registration


STUB_LAUNCHERS = r"""
// The real csrc bindings with their launchers stubbed (never called): what the dispatcher sees
// when the extension loads.
#include "fp8/quant_binding.cpp"
#include "moe/align_binding.cpp"
namespace primerl { namespace fp8 {
const char* error_string(int) { return "stub"; }
int quant_rows(const void*, InDType, void*, OutDType, float*, int64_t, int64_t, bool, bool, CUstream_st*) { return 1; }
int quant_blocks(const void*, InDType, void*, OutDType, float*, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                 bool, CUstream_st*) { return 1; }
int64_t quant_tensorwise_workspace(int64_t) { return 1; }
int quant_tensorwise(const void*, InDType, void*, OutDType, float*, float*, int64_t, bool, CUstream_st*) { return 1; }
}}
namespace primerl { namespace moe {
int64_t align_workspace(int64_t, int32_t) { return 1; }
cudaError_t align(const int32_t*, int64_t, int32_t, int32_t, int32_t*, int32_t*, int32_t*, int32_t*, int32_t*,
                  int32_t*, cudaStream_t) { return cudaErrorUnknown; }
cudaError_t scatter_rows(const void*, DType, const int32_t*, const float*, void*, int64_t, int32_t, int64_t,
                         cudaStream_t) { return cudaErrorUnknown; }
}}
"""


def _cuda_root() -> str | None:
    import shutil

    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    return None


@pytest.fixture(scope="module")
def binding_library(tmp_path_factory):
    """csrc's binding .cpp files + stub launchers, built as a CPU shared library (~10 s)."""
    import shutil

    from torch.utils.cpp_extension import include_paths, library_paths

    cuda = _cuda_root()
    if cuda is None or shutil.which("g++") is None or not os.path.exists(os.path.join(cuda, "lib64", "libcudart.so")):
        pytest.skip("needs g++ and the CUDA toolkit's headers and libcudart (the bindings include cuda_runtime.h)")
    tmp = tmp_path_factory.mktemp("bindings")
    (tmp / "stub.cpp").write_text(STUB_LAUNCHERS)
    lib, torch_lib = tmp / "libbindings.so", library_paths()[0]
    cmd = ["g++", "-std=c++17", "-w", "-O0", "-shared", "-fPIC", f"-I{REPO / 'csrc'}",
           *[f"-I{p}" for p in include_paths()], f"-I{cuda}/include", str(tmp / "stub.cpp"), "-o", str(lib),
           f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-L{cuda}/lib64", "-lcudart",
           f"-Wl,-rpath,{torch_lib}", f"-Wl,-rpath,{cuda}/lib64"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return lib


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300)


def test_extension_registers_cuda_kernels_against_the_python_schemas(binding_library):
    """Loaded as primerl._C: no schema is defined twice, the dispatcher accepts the C++ kernels'
    inferred signatures against the Python schemas, the active CUDA kernel of every op is the
    binding's (none overridden), and the fake kernels are there."""
    res = _run_python(f"""
        import sys, types, warnings, torch
        warnings.filterwarnings("error", message=".*Overriding a previously registered kernel")
        torch.ops.load_library({str(binding_library)!r})
        sys.modules["primerl._C"] = types.ModuleType("primerl._C")  # the extension module itself holds no ops
        import primerl.kernels._ext as ext
        assert ext.HAS_CUDA_EXT
        for name in ext.CSRC_OPS:
            dump = torch._C._dispatch_dump("primerl::" + name)
            cuda = [line for line in dump.splitlines() if line.startswith("CUDA")]
            assert len(cuda) == 1 and "_binding.cpp" in cuda[0], dump
            assert "Meta: registered at" in dump and "_ext.py" in dump.split("Meta:")[1].splitlines()[0], dump
        print("ok")
    """)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_extension_schema_mismatch_is_loud_and_old_builds_are_accepted(binding_library):
    """A C++ kernel whose signature disagrees with the Python schema fails the import (here: num_rows
    declared float); an extension built from older sources, which defined the schemas itself, is
    accepted (the schema is not defined again, the fake kernel is added)."""
    res = _run_python(f"""
        import torch
        torch.ops.load_library({str(binding_library)!r})
        torch.library.define("primerl::moe_scatter_rows",
                             "(Tensor src, Tensor row_map, Tensor? scale, float num_rows) -> Tensor")
    """)
    assert res.returncode != 0 and "doesn't match the expected function schema" in res.stderr, res.stderr[-3000:]
    res = _run_python("""
        import torch
        lib = torch.library.Library("primerl", "FRAGMENT")  # what an older primerl._C defined at load
        lib.define("moe_align(Tensor topk_ids, int num_experts, int block) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
        import primerl.kernels  # noqa: F401
        out = torch.ops.primerl.moe_align(torch.zeros(3, 2, dtype=torch.int32, device="meta"), 4, 2)
        assert [tuple(t.shape) for t in out] == [(6,), (10,), (5,), (1,), (4,)], out
        print("ok")
    """)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


# ------------------------------------------------------------------------------ DeepGEMM: one node per call


class _StandInDeepGemm:
    """Stands in for the deep_gemm module (primerl's marshalling only, not DeepGEMM): each entry point
    writes d from its operands, a value eager and compiled runs must agree on bitwise, and records
    the call."""

    def __init__(self):
        self.calls = []

    def _write(self, name, a, b, d, c=None):
        self.calls.append(name)
        value = (a[0].float().sum() + b[0].float().sum() + a[1].float().sum()).expand(d.shape)
        if c is None:
            d.copy_(value)
        else:  # D = A B + C
            d.copy_(value + c)

    def fp8_gemm_nt(self, a, b, d, c=None, recipe=None):
        self._write("fp8_gemm_nt", a, b, d, c)

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, layout, recipe=None, use_psum_layout=False):
        self._write("m_grouped_fp8_gemm_nt_contiguous", a, b, d)

    def m_grouped_fp8_gemm_nt_masked(self, a, b, d, masked_m, expected_m, recipe=None):
        self._write("m_grouped_fp8_gemm_nt_masked", a, b, d)

    def k_grouped_fp8_gemm_tn_contiguous(self, a, b, d, ks, ks_tensor, c=None, recipe=None):
        assert isinstance(ks, list) and ks_tensor.tolist() == ks and (c is None or c is d)
        self._write("k_grouped_fp8_gemm_tn_contiguous", a, b, d, c)


@pytest.fixture
def deep_gemm_traceable(monkeypatch):
    """The deep_gemm backend as available on an SM90 / SM100 device (``arch.major``), with the
    stand-in module: DeepGEMM itself is not here."""
    arch = types.SimpleNamespace(major=9, module=_StandInDeepGemm())
    monkeypatch.setattr(FG, "resolve_backend", lambda op, backend, *args, **kwargs: backend)
    monkeypatch.setattr(DG, "device_capability", lambda device: (arch.major, 0))
    monkeypatch.setitem(sys.modules, "deep_gemm", arch.module)
    return arch


def _deep_gemm_cases():
    """(name, the public call taking the backend first, its operands on CPU, the op it must become, arch)."""
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    a = F8.quant_per_token_group(r(256, 512), 128, ue8m0=True)
    b = F8.quant_per_block(r(384, 512), ue8m0=True)
    b_rows = F8.quant_per_token_group(r(384, 512), 128, ue8m0=True)
    bg = F8.quant_per_block(r(3, 384, 512), ue8m0=True)
    counts = torch.tensor([100, 0, 40], dtype=torch.int32)
    xp, m_idx, _ = G.pad_to_contiguous(r(140, 512), G.counts_to_offsets(counts))
    ap = F8.quant_per_token_group(xp, 128, ue8m0=True)
    psum = G.counts_to_psum(counts)
    am = F8.quant_per_token_group(r(3, 64, 512), 128, ue8m0=True)
    masked = torch.tensor([0, 5, 64], dtype=torch.int32)
    offs = G.counts_to_offsets(torch.tensor([256, 0, 128], dtype=torch.int32))
    ka = G.quant_per_group_colwise(r(400, 64), offs, ue8m0=True, backend="torch")
    kb = G.quant_per_group_colwise(r(400, 32), offs, ue8m0=True, backend="torch")
    c = torch.randn(3, 64, 32, generator=g)
    return [
        ("fp8_gemm_nt", lambda be, a0, a1, b0, b1: G.fp8_gemm_nt((a0, a1), (b0, b1), backend=be), (*a, *b),
         "deep_gemm_fp8_gemm_nt", 9),
        ("fp8_gemm_nt(1,1,128)", lambda be, a0, a1, b0, b1: G.fp8_gemm_nt((a0, a1), (b0, b1), recipe=(1, 1, 128),
                                                                           backend=be), (*a, *b_rows),
         "deep_gemm_fp8_gemm_nt", 10),
        ("m_grouped_contiguous", lambda be, a0, a1, b0, b1, i: G.m_grouped_fp8_gemm_nt_contiguous(
            (a0, a1), (b0, b1), i, backend=be), (*ap, *bg, m_idx), "deep_gemm_m_grouped_fp8_gemm_nt_contiguous", 9),
        ("m_grouped_contiguous(psum)", lambda be, a0, a1, b0, b1, p: G.m_grouped_fp8_gemm_nt_contiguous(
            (a0, a1), (b0, b1), p, use_psum_layout=True, backend=be), (*ap, *bg, psum),
         "deep_gemm_m_grouped_fp8_gemm_nt_contiguous", 9),
        ("m_grouped_masked", lambda be, a0, a1, b0, b1, m: G.m_grouped_fp8_gemm_nt_masked(
            (a0, a1), (b0, b1), m, 32, backend=be), (*am, *bg, masked), "deep_gemm_m_grouped_fp8_gemm_nt_masked", 9),
        ("k_grouped", lambda be, a0, a1, b0, b1, o: G.k_grouped_fp8_gemm_tn_contiguous(
            (a0, a1), (b0, b1), o, backend=be), (*ka, *kb, offs), "deep_gemm_k_grouped_fp8_gemm_tn_contiguous", 10),
        ("k_grouped(c)", lambda be, a0, a1, b0, b1, o, c: G.k_grouped_fp8_gemm_tn_contiguous(
            (a0, a1), (b0, b1), o, c=c, backend=be), (*ka, *kb, offs, c),
         "deep_gemm_k_grouped_fp8_gemm_tn_contiguous", 10),
    ]


DG_CASES = _deep_gemm_cases()


# fake CUDA tensors cannot be indexed on this CPU build (select / slice take a CUDA device guard):
# the psum and k-grouped front-ends index their offsets, so those trace with fake CUDA only on a GPU
FAKE_CUDA_FAILS = ("m_grouped_contiguous(psum)", "k_grouped", "k_grouped(c)")


@pytest.mark.no_poison
@pytest.mark.parametrize("name,fn,inputs,op,arch", DG_CASES, ids=[c[0] for c in DG_CASES])
def test_deep_gemm_backend_compiles_fullgraph_to_one_node(deep_gemm_traceable, name, fn, inputs, op, arch):
    """The public FP8 GEMMs with backend="deep_gemm" (the stand-in module), compiled with fullgraph
    on CPU tensors: bitwise the eager result, and exactly one ``primerl::deep_gemm_*`` node per call
    (DeepGEMM's call with the scale layout, the k-grouped sizes' host read and the padding fix-ups
    inside it: nothing outside it reads the host, else fullgraph would fail). FakeTensorMode, meta
    tensors and (where this CPU build can) fake CUDA tensors give the torch backend's shapes."""
    deep_gemm_traceable.major = arch
    want = _sig(fn("torch", *inputs))
    dg = lambda *t: fn("deep_gemm", *t)  # noqa: E731
    with K.debug_checks(False):
        eager = dg(*inputs)
        assert _sig(eager) == want and deep_gemm_traceable.module.calls
        graphs = _Graphs()
        assert torch.equal(torch.compile(dg, backend=graphs, fullgraph=True)(*inputs), eager)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(dg, backend="aot_eager", fullgraph=True)(*inputs), eager)
        assert graphs.primerl_calls() == {op: 1}
        calls = len(deep_gemm_traceable.module.calls)
        for device in ["cpu"] + ([] if name in FAKE_CUDA_FAILS else ["cuda"]):
            mode = FakeTensorMode()
            fake = [_fake_like(mode, t, device) for t in inputs]
            with mode:
                assert _sig(dg(*fake)) == want
                if device == "cuda":
                    torch._dynamo.reset()
                    assert _sig(torch.compile(dg, backend="aot_eager", fullgraph=True)(*fake)) == want
        assert _sig(dg(*[t.to("meta") for t in inputs])) == want
        assert len(deep_gemm_traceable.module.calls) == calls  # fake and meta runs never reach DeepGEMM


def test_deep_gemm_ops_opcheck(deep_gemm_traceable):
    """torch.library.opcheck of the four primerl::deep_gemm_* ops (fake kernel, autograd registration,
    aot dispatch incl. the mutation of d; the schema declares d, and only d, written) around the
    stand-in module; with the real DeepGEMM: the gpu test."""
    g = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    aq, asf = F8.quant_per_token_group(r(128, 256), 128, ue8m0=True)
    bq, bsf = F8.quant_per_block(r(3, 256, 256), ue8m0=True)
    bq2, bsf2 = F8.quant_per_block(r(256, 256), ue8m0=True)
    m_idx = torch.arange(128, dtype=torch.int32) % 4 - 1
    offs = G.counts_to_offsets(torch.tensor([128, 0], dtype=torch.int32))
    (ka, kas), (kb, kbs) = (G.quant_per_group_colwise(r(128, n), offs, ue8m0=True, backend="torch") for n in (32, 16))
    d = lambda *s: torch.zeros(*s)  # noqa: E731
    samples = [  # one per op, SM90 (SM100 for the k-grouped op, which exists only there)
        ("deep_gemm_fp8_gemm_nt", (aq, asf, bq2, bsf2, d(128, 256), d(128, 256) + 1, False, [1, 128, 128], 9)),
        ("deep_gemm_m_grouped_fp8_gemm_nt_contiguous", (aq, asf, bq, bsf, m_idx, m_idx, d(128, 256), False,
                                                        [1, 128, 128], 9)),
        ("deep_gemm_m_grouped_fp8_gemm_nt_masked", (aq.view(1, 128, 256), asf.view(1, 128, 2), bq[:1], bsf[:1],
                                                    torch.tensor([100], dtype=torch.int32), 64, d(1, 128, 256),
                                                    [1, 128, 128], 9)),
        ("deep_gemm_k_grouped_fp8_gemm_tn_contiguous", (ka, kas, kb, kbs, torch.tensor([128, 0]), d(2, 32, 16),
                                                        d(2, 32, 16) + 2, False)),
    ]
    for op, args in samples:
        deep_gemm_traceable.major = 10 if "k_grouped" in op else 9
        overload = getattr(torch.ops.primerl, op).default
        writes = [a.name for a in overload._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert writes == ["d"], (op, writes)
        # test_schema compares the fp8 inputs before and after with arithmetic CPU fp8 lacks
        torch.library.opcheck(overload, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                          "test_aot_dispatch_dynamic"))


@pytest.mark.no_poison
def test_external_backend_resolution_is_a_compile_time_constant(monkeypatch):
    """Choosing deep_gemm / flash_attn (named, or by backend=None on CUDA, which tries DeepGEMM
    first) probes the package with an import dynamo will not trace: backend_status is evaluated at
    trace time, so a fullgraph compile on (fake) CUDA tensors picks them as eager does. The same for
    the device's compute capability (DeepGEMM's and cuBLAS's architecture checks)."""
    import importlib

    imported = []

    def external_status(module, hint):  # the real probe, with stand-in modules and device
        imported.append(importlib.import_module(module).__name__)
        return _backend.BackendStatus(True, "stand-in")

    def capability(device=None):  # the CUDA query, on a fake device: not traceable (an import)
        importlib.import_module("math")
        return (9, 0)

    for name in ("deep_gemm", "flash_attn"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(_backend, "_external_status", external_status)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)

    def fn(x):
        named = _backend.resolve_backend("op", "deep_gemm", x.device, supported=("torch", "deep_gemm"))
        auto = _backend.resolve_backend("op", None, x.device, supported=("torch", "triton", "deep_gemm"),
                                        preference=("deep_gemm", "triton", "torch"))
        fa = _backend.resolve_backend("op", "flash_attn", x.device, supported=("torch", "flash_attn"))
        arch = DG._check_arch_recipe("op", x.device, (1, 128, 128))  # DeepGEMM's and cuBLAS's capability query
        return torch.cat([x, x]) if (named, auto, fa, arch) == ("deep_gemm", "deep_gemm", "flash_attn", 9) else x

    mode = FakeTensorMode()
    with mode:
        x = torch.empty(4, device="cuda")
        out = torch.compile(fn, backend=_Graphs(), fullgraph=True)(x)
    assert out.shape == (8,) and set(imported) == {"deep_gemm", "flash_attn"}


# ------------------------------------------------------------------------------ cuBLAS (F.scaled_mm)


@pytest.mark.no_poison
def test_cublas_probe_is_a_compile_time_constant(monkeypatch):
    """backend=None / "cublas" asks the once-per-device probe whether cuBLAS gets a case right. Its
    GEMMs and host reads must not enter a traced graph: under torch.compile (fullgraph) the probe
    runs eagerly, once, at trace time (its GEMM stood in for by one with a host read, as the real
    one's calc_diff), and later compiles reuse it."""
    runs = []

    def probe_gemm(m, n, k, pad_k, device):
        runs.append((m, n, k, pad_k))
        return None if float(torch.ones(1).sum()) == 1.0 else "no"

    monkeypatch.setattr(CB, "_try", probe_gemm)
    monkeypatch.setattr(CB, "device_capability", lambda device: (9, 0))
    CB.probe.cache_clear()

    def fn(x):
        why = CB.reason(x.shape[0], 256, 384, E4M3, E4M3, 128, torch.bfloat16, False, x.device)
        return x * (2 if why is None else 3)

    try:
        mode = FakeTensorMode()
        for m in (64, 80):
            with mode:
                x = torch.empty(m, 8, device="cuda")
            torch._dynamo.reset()
            with mode:
                assert torch.compile(fn, backend="aot_eager", fullgraph=True)(x).shape == (m, 8)
            assert len(runs) == 4  # base case, padded K, partial N, odd M: once per process
    finally:
        CB.probe.cache_clear()


@pytest.mark.no_poison
@pytest.mark.parametrize("k", [512, 384])
def test_cublas_call_traces_without_host_reads(monkeypatch, k):
    """The cuBLAS call (scale layouts + F.scaled_mm) on meta tensors: torch's shape rules pass, no
    host read, and torch.compile traces it fullgraph to one _scaled_mm_v2 (K/128 = 3: the padded
    B-scale layout the probe chose)."""
    monkeypatch.setattr(CB, "device_support", lambda index: CB.Support(True, True, True, True, ""))
    monkeypatch.setattr(CB, "_index", lambda device: 0)
    meta = lambda *s, dtype=torch.float32: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
    args = (meta(64, k, dtype=E4M3), meta(64, k // 128), meta(256, k, dtype=E4M3), meta(2, k // 128))

    def fn(aq, asf, bq, bsf):
        return CB.fp8_gemm_nt((aq, asf), (bq, bsf), None)

    with count_host_reads() as reads:
        out = fn(*args)
    assert reads.total == 0 and out.shape == (64, 256) and out.dtype == torch.bfloat16
    graphs = _Graphs()
    assert torch.compile(fn, backend=graphs, fullgraph=True)(*args).shape == (64, 256)
    targets = [str(n.target) for gm in graphs.graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("scaled_mm" in t for t in targets) == 1, targets


# ------------------------------------------------------------------------------ flash-attn


def _stand_in_flash_attn(calls):
    from primerl.kernels.attention import reference as AR

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False,
                               return_attn_probs=False):
        calls.append((max_q, max_k))
        pos = AR.default_positions(cu_q, cu_k, q.shape[0], k.shape[0])
        out, lse = AR.attention_dense(q, k, v, cu_q, cu_k, causal, softmax_scale, *pos)
        return out, lse, None

    module = types.ModuleType("flash_attn")  # a module: dynamo traces the import
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


@pytest.mark.no_poison
def test_flash_attn_backend_with_max_seqlen_reads_nothing_on_the_host(monkeypatch):
    """attention(backend="flash_attn", max_seqlen=...) around a stand-in flash_attn module (plain torch,
    so this checks primerl's side only): no host read, and it compiles fullgraph, forward and
    backward, bitwise eager; flash-attn gets the caller's max_seqlen. Without max_seqlen the offsets
    are read on the host (once per tensor, cached), which a fullgraph trace refuses: pass it."""
    from primerl.kernels import attention as A
    from primerl.kernels.attention import ops as attention_ops

    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", _stand_in_flash_attn(calls))
    monkeypatch.setattr(attention_ops, "resolve_backend", lambda op, backend, *args, **kwargs: backend)
    cu = torch.tensor([0, 3, 8, 11], dtype=torch.int32)

    def inputs():
        return [torch.randn(11, h, 16, generator=torch.Generator().manual_seed(h)).requires_grad_() for h in (4, 2, 2)]

    def fn(q, k, v):
        return A.attention(q, k, v, cu_seqlens=cu, max_seqlen=5, backend="flash_attn")

    def run(f):
        q, k, v = inputs()
        out = f(q, k, v)
        (out * torch.linspace(0.5, 1.5, out.numel()).view(out.shape)).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    with K.debug_checks(False):
        with count_host_reads() as reads:
            want = run(fn)
        assert reads.total == 0, reads.where
        got = run(torch.compile(fn, backend="aot_eager", fullgraph=True))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert calls and all(c == (5, 5) for c in calls)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="data-dependent|Data-dependent|tolist|item"):
            torch.compile(lambda q, k, v: A.attention(q, k, v, cu_seqlens=cu, backend="flash_attn"),
                          backend="aot_eager", fullgraph=True)(*inputs())


# ------------------------------------------------------------------------------ gpu: the real kernels


def _bitwise(got, want, what: str) -> None:
    got = [got] if isinstance(got, torch.Tensor) else list(got)
    want = [want] if isinstance(want, torch.Tensor) else list(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}[{i}]"
        assert torch.equal(g.view(torch.uint8) if g.element_size() == 1 else g,
                           w.view(torch.uint8) if w.element_size() == 1 else w), f"{what}[{i}]: not bitwise eager"


@pytest.mark.gpu
@pytest.mark.no_poison
@pytest.mark.skipif(not _ext.HAS_CUDA_EXT,
                    reason="primerl._C not built (PRIMERL_BUILD_CUDA=1 python setup.py build_ext --inplace)")
def test_gpu_csrc_ops_opcheck_and_compiled_bitwise():
    """The extension's kernels: opcheck of every csrc op (schema, fake kernel vs the kernel's outputs,
    aot dispatch), and the public backend="cuda" ops compiled (fullgraph, aot_eager and inductor)
    bitwise their eager results."""
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(37, 512, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(2, 300, 260, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, device="cuda", generator=g)[:2] for _ in range(37)]).to(torch.int32)
    row_map = torch.randperm(74, device="cuda", generator=g).view(37, 2).to(torch.int32)
    for name, args in [
        ("fp8_quant_per_token_group", (x, 128, E4M3, False, True)),
        ("fp8_quant_per_token_group", (x, 64, E5M2, True, False)),
        ("fp8_quant_per_block", (w, 128, 128, E4M3, True, True)),
        ("fp8_quant_rowwise", (x, E4M3, False)),
        ("fp8_quant_tensorwise", (x, E5M2, False)),
        ("moe_align", (ids, 8, 16)),
        ("moe_scatter_rows", (x, row_map, None, 80)),
        ("moe_scatter_rows", (x, row_map, torch.rand(37, 2, device="cuda", generator=g), 74)),
    ]:
        torch.library.opcheck(getattr(torch.ops.primerl, name).default, args)

    def fn(x, w, ids):
        return (*F8.quant_per_token_group(x, 128, backend="cuda"), *F8.quant_per_block(w, backend="cuda"),
                *F8.quant_rowwise(x, backend="cuda"), *F8.quant_tensorwise(x, backend="cuda"),
                M.expert_counts(ids, 8, backend="cuda"), *M.moe_align(ids, 8, 16, backend="cuda"),
                *M.permute(x, ids, 8, backend="cuda"))

    with K.debug_checks(False):
        want = fn(x, w, ids)
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            _bitwise(torch.compile(fn, backend=backend, fullgraph=True)(x, w, ids), want, backend)


@pytest.mark.gpu
@pytest.mark.no_poison
def test_gpu_deep_gemm_opcheck_and_compiled_bitwise():
    """The real DeepGEMM (SM90 / SM100, built by the user): opcheck of primerl::deep_gemm_fp8_gemm_nt
    and the m-grouped contiguous op, and fp8_gemm_nt(backend="deep_gemm") compiled fullgraph bitwise
    its eager result."""
    pytest.importorskip("deep_gemm", reason="DeepGEMM is not installed (built from source by the user)")
    major = torch.cuda.get_device_capability()[0]
    if major not in (9, 10):
        pytest.skip("DeepGEMM runs on SM90 and SM100")
    g = torch.Generator(device="cuda").manual_seed(7)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    a = F8.quant_per_token_group(r(256, 512), 128, ue8m0=True)
    b = F8.quant_per_block(r(384, 512), ue8m0=True)
    bg = F8.quant_per_block(r(2, 384, 512), ue8m0=True)
    m_idx = (torch.arange(256, device="cuda", dtype=torch.int32) // 128).contiguous()
    d = torch.zeros(256, 384, dtype=torch.bfloat16, device="cuda")
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")  # as on CPU: fp8 inputs
    torch.library.opcheck(torch.ops.primerl.deep_gemm_fp8_gemm_nt.default,
                          (*a, *b, d, None, False, [1, 128, 128], major), test_utils=utils)
    torch.library.opcheck(torch.ops.primerl.deep_gemm_m_grouped_fp8_gemm_nt_contiguous.default,
                          (*a, *bg, m_idx, m_idx, d.clone(), False, [1, 128, 128], major), test_utils=utils)

    def fn(a0, a1, b0, b1):
        return G.fp8_gemm_nt((a0, a1), (b0, b1), backend="deep_gemm")

    want = fn(*a, *b)
    assert calc_diff(want, G.fp8_gemm_nt(a, b, backend="torch")) < 1e-5
    _bitwise(torch.compile(fn, backend="aot_eager", fullgraph=True)(*a, *b), want, "deep_gemm compiled")


@pytest.mark.gpu
@pytest.mark.no_poison
def test_gpu_cublas_compiled_bitwise():
    """fp8_gemm_nt through cuBLAS (SM90), named and chosen by backend=None, compiled fullgraph with
    the probe a trace-time constant: bitwise the eager result."""
    if torch.cuda.get_device_capability()[0] != 9 or CB.api_reason() is not None:
        pytest.skip("cuBLAS blockwise FP8 runs on SM90 with torch's F.scaled_mm")
    g = torch.Generator(device="cuda").manual_seed(8)
    a = F8.quant_per_token_group(torch.randn(256, 384, device="cuda", generator=g).to(torch.bfloat16), 128)
    b = F8.quant_per_block((torch.randn(512, 384, device="cuda", generator=g) * 0.05).to(torch.bfloat16))
    if CB.reason(256, 512, 384, E4M3, E4M3, 128, torch.bfloat16, False, a[0].device) is not None:
        pytest.skip("this cuBLAS does not take the case")
    for backend in ("cublas", None):
        def fn(a0, a1, b0, b1, backend=backend):
            return G.fp8_gemm_nt((a0, a1), (b0, b1), backend=backend)

        want = fn(*a, *b)
        torch._dynamo.reset()
        _bitwise(torch.compile(fn, backend="aot_eager", fullgraph=True)(*a, *b), want, f"cublas ({backend})")


@pytest.mark.gpu
@pytest.mark.no_poison
def test_gpu_flash_attn_compiled():
    """The real flash-attn (its own custom ops, flash_attn::_flash_attn_varlen_forward / _backward):
    attention(backend="flash_attn", max_seqlen=...) compiled fullgraph, forward bitwise eager,
    gradients within calc_diff 1e-5 of eager (flash-attn's dq accumulates with atomics)."""
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    from primerl.kernels import attention as A

    cu = torch.tensor([0, 100, 356, 400], dtype=torch.int32, device="cuda")

    def run(f):
        q, k, v = [torch.randn(400, h, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(h))
                   .to(torch.bfloat16).requires_grad_() for h in (8, 2, 2)]
        out = f(q, k, v)
        out.float().square().sum().backward()
        return out.detach(), [q.grad, k.grad, v.grad]

    def fn(q, k, v):
        return A.attention(q, k, v, cu_seqlens=cu, max_seqlen=256, backend="flash_attn")

    with K.debug_checks(False):
        out, grads = run(fn)
        got_out, got_grads = run(torch.compile(fn, backend="aot_eager", fullgraph=True))
    _bitwise(got_out, out, "flash_attn out")
    for gg, gw in zip(got_grads, grads):
        assert calc_diff(gg.float(), gw.float()) < 1e-5
