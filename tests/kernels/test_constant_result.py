"""``primerl.kernels._constant_result.assume_constant_result``: the mark torch's decorator sets, honoured
by torch.compile, and importing primerl does not import torch._dynamo (the point of it)."""

from __future__ import annotations

import subprocess
import sys

import torch

from primerl.kernels._constant_result import assume_constant_result


def test_the_mark_is_the_one_torchs_decorator_sets():
    import torch._dynamo.decorators as decorators

    def ours():
        return 1

    def theirs():
        return 1

    before = set(vars(theirs))
    assert decorators.assume_constant_result(theirs) is theirs
    assert assume_constant_result(ours) is ours
    assert {k: v for k, v in vars(theirs).items() if k not in before} == dict(vars(ours))


def test_compile_calls_a_marked_function_at_trace_time_and_keeps_its_result():
    calls = []

    @assume_constant_result
    def scale() -> float:
        calls.append(1)
        return 3.0

    def f(x):
        return x * scale()

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(f, backend=backend, fullgraph=True)
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), x * 3.0)
    n = len(calls)
    torch.testing.assert_close(compiled(x + 1), (x + 1) * 3.0)
    assert len(calls) == n, "a marked function is not called again by the compiled graph"
    assert all("scale" not in str(node.target) for gm in graphs for node in gm.graph.nodes)


def test_importing_primerl_does_not_import_dynamo():
    code = ("import sys, primerl.kernels, primerl.models, primerl.runtime.cli; "
            "sys.exit(3 if 'torch._dynamo' in sys.modules else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, "importing primerl imported torch._dynamo (1.4 s of CPU per process)\n" + r.stderr[-2000:]
