"""bench --json (rows as JSON lines) and bench/targets.py (issues 22-24's done-when targets).

- the JSON rows round-trip, through ``python -m bench <op> --json`` too;
- targets evaluate PASS / MISS / NOT RUN (with why) on synthetic rows, step records, JUnit files;
- every row a target reads is one the bench modules emit on CUDA: each module's CUDA code runs
  here under FakeTensorMode (tensors with device "cuda" and no data), timing replaced by a
  constant, so its real row construction names the rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from unittest import mock

import pytest
import torch

import bench.__main__ as bench_main
from bench import targets as T
from bench.harness import Row, read_jsonl, row_from_json, row_to_json

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ JSON rows


def _same(a: Row, b: Row) -> bool:
    da, db = dict(vars(a)), dict(vars(b))
    ma, mb = da.pop("median_s"), db.pop("median_s")
    return da == db and (ma == mb or (math.isnan(ma) and math.isnan(mb)))


def test_rows_round_trip_through_json(tmp_path):
    rows = [Row("fp8_gemm_nt", "4096x7168x16384", "fp8e4m3->bf16", "None", 1.25e-3, tflops=812.5, ratio=1.07,
                baseline="bf16 mm", extra={"vs_blockwise": "0.93x"}, values={"peak_bytes": 123456789012}),
            Row("moe_experts_fwd_bwd", "T=1", "bf16", "primerl_bf16", float("nan"),
                extra={"error": 'Bad "quote"\n2nd'}),
            Row("x", "s", "d", "b", 2.0, gbps=float("inf"), values={"v": float("nan"), "nested": [1, 2.5]})]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(row_to_json(r, "gemm") + "\n" for r in rows))
    recs = read_jsonl(path)
    assert [r["module"] for r in recs] == ["gemm"] * 3 and all(r["kind"] == "row" for r in recs)
    back = [row_from_json(r) for r in recs]
    assert _same(back[0], rows[0]) and _same(back[1], rows[1])
    # non-finite numbers are written as null (strict JSON), not as the original value
    assert back[2].gbps is None and back[2].values == {"v": None, "nested": [1, 2.5]}
    # a module with rows of its own kind (aot's reports): field by field, never taken for a Row
    report = json.loads(row_to_json(_Report("moe align", 0.5), "aot"))
    assert report == {"kind": "_Report", "module": "aot", "kernel": "moe align", "spills": 0.5}


@dataclasses.dataclass
class _Report:
    kernel: str
    spills: float


def test_read_jsonl_leaves_out_a_broken_line(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text(row_to_json(Row("a", "s", "d", "b", 1.0), "m") + "\n" + '{"kind": "row", "op": "tru\n')
    assert [r["op"] for r in read_jsonl(path)] == ["a"]
    assert "unreadable line" in capsys.readouterr().err


def _fake_bench_module(rows=None, exc=None):
    mod = types.ModuleType("bench.fakeop")

    def run(args):
        if exc is not None:
            raise exc
        return rows

    mod.run = run
    return mod


def test_bench_main_appends_json_rows_and_module_errors(tmp_path, monkeypatch, capsys):
    path = tmp_path / "rows.jsonl"
    rows = [Row("op", "s", "bf16", "triton", 1e-3, ratio=2.0, baseline="torch", values={"peak_bytes": 7})]
    monkeypatch.setattr(bench_main, "available_ops", lambda: ["fakeop"])
    monkeypatch.setitem(sys.modules, "bench.fakeop", _fake_bench_module(rows))
    assert bench_main.main(["fakeop", "--device", "cpu", "--json", str(path)]) == 0
    assert bench_main.main(["fakeop", "--device", "cpu", "--json", str(path)]) == 0  # appends
    recs = read_jsonl(path)
    assert len(recs) == 2 and _same(row_from_json(recs[1]), rows[0]) and recs[0]["module"] == "fakeop"
    assert "## fakeop" in capsys.readouterr().out  # the printed table stays
    monkeypatch.setitem(sys.modules, "bench.fakeop", _fake_bench_module(exc=RuntimeError("no CUDA kernel")))
    with pytest.raises(RuntimeError):
        bench_main.main(["fakeop", "--device", "cpu", "--json", str(path)])
    assert read_jsonl(path)[-1] == {"kind": "module_error", "module": "fakeop", "error": "RuntimeError: no CUDA kernel"}


def test_a_module_stopped_by_sigterm_hands_over_its_finished_rows(tmp_path, monkeypatch, capsys):
    """gpu_check.sh's `timeout` sends SIGTERM at a module's limit: the rows made so far are written."""
    path = tmp_path / "rows.jsonl"
    mod = types.ModuleType("bench.fakeop")

    def run(args):
        rows = [Row("op", f"s{i}", "bf16", "triton", 1e-3, ratio=1.5, baseline="torch") for i in range(2)]
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(600)  # the handler interrupts this (else pytest-timeout fails the test)
        return rows + [Row("op", "never", "bf16", "triton", 1e-3)]

    mod.run = run
    monkeypatch.setattr(bench_main, "available_ops", lambda: ["fakeop"])
    monkeypatch.setitem(sys.modules, "bench.fakeop", mod)
    before = signal.getsignal(signal.SIGTERM)
    assert bench_main.main(["fakeop", "--device", "cpu", "--json", str(path)]) == 124
    assert signal.getsignal(signal.SIGTERM) is before
    recs = read_jsonl(path)
    assert [r.get("shape") for r in recs[:2]] == ["s0", "s1"] and len(recs) == 3
    assert recs[2]["kind"] == "module_error" and "stopped by SIGTERM" in recs[2]["error"]
    assert "stopped by SIGTERM" in capsys.readouterr().out
    # the stopped module's missing rows say why in the targets table
    t = T.RowTarget("x", "t", "fakeop", T.Sel("op", ("triton",)), ("s0", "never"), T.own_ratio, ">=", 1.0)
    r = T.evaluate(t, T.RunData(recs))
    assert (r.status, r.measured) == (T.NOT_RUN, "1.50x -") and "stopped by SIGTERM" in r.why


def test_targets_is_no_bench_op():
    assert "targets" not in bench_main.available_ops()


# ------------------------------------------------------------------------------ evaluation


def _rec(module, op, shape, backend, s, **kw):
    return json.loads(row_to_json(Row(op, shape, kw.pop("dtype", "bf16"), backend, s, **kw), module))


def _status(step, status, seconds=0, detail=""):
    return {"kind": "status", "step": step, "status": status, "seconds": seconds, "detail": detail}


SPEED = T.RowTarget("23", "speed", "gemm", T.Sel("fast", ("triton",)), ("A", "B"), T.speedup, ">=", 1.4,
                    base=T.Sel("slow", ("torch",)))


def test_speedup_target_pass_miss_and_not_run():
    base = [_rec("gemm", "slow", s, "torch", 3.0) for s in ("A", "B")]
    r = T.evaluate(SPEED, T.RunData(base + [_rec("gemm", "fast", "A", "triton", 2.0),
                                            _rec("gemm", "fast", "B", "triton", 1.5)]))
    assert (r.status, r.measured, r.threshold) == (T.PASS, "1.50x 2.00x", ">= 1.40x")
    r = T.evaluate(SPEED, T.RunData(base + [_rec("gemm", "fast", "A", "triton", 2.5),
                                            _rec("gemm", "fast", "B", "triton", 1.5)]))
    assert (r.status, r.measured) == (T.MISS, "1.20x 2.00x")
    # one shape an error row: NOT RUN with the error, the other's value still shown
    r = T.evaluate(SPEED, T.RunData(base + [_rec("gemm", "fast", "A", "triton", float("nan"),
                                                 extra={"error": "OutOfResources: shared memory"}),
                                            _rec("gemm", "fast", "B", "triton", 1.5)]))
    assert (r.status, r.measured) == (T.NOT_RUN, "- 2.00x") and r.why == "triton: error OutOfResources: shared memory"
    two = T.RunData(base + [_rec("gemm", "fast", s, "triton", float("nan"), extra={"error": f"E{s}"}) for s in "AB"])
    assert T.evaluate(SPEED, two).why == "A: triton: error EA; B: triton: error EB"  # per shape when they differ
    # a MISS beside a NOT RUN is a MISS, and says what was not run
    r = T.evaluate(SPEED, T.RunData(base + [_rec("gemm", "fast", "A", "triton", 2.5)]))
    assert r.status == T.MISS and "1 of 2 not run" in r.why
    # the baseline failing is NOT RUN too, named as the baseline
    r = T.evaluate(SPEED, T.RunData([_rec("gemm", "slow", "A", "torch", float("nan"),
                                          extra={"skipped": "budget 70s spent"}),
                                     _rec("gemm", "fast", "A", "triton", 1.0)]))
    assert r.status == T.NOT_RUN and "baseline torch: skipped: budget 70s spent" in r.why


def test_not_run_says_why_the_module_gave_no_rows():
    timeout = T.RunData([_status("bench gemm", "TIMEOUT", 90, "log: bench.log")])
    r = T.evaluate(SPEED, timeout)
    assert r.status == T.NOT_RUN and "bench gemm TIMEOUT after 90 s" in r.why
    r = T.evaluate(SPEED, T.RunData([_status("bench gemm", "skipped", 0, "time budget (420s) spent")]))
    assert r.status == T.NOT_RUN and "time budget (420s) spent" in r.why
    r = T.evaluate(SPEED, T.RunData([{"kind": "module_error", "module": "gemm", "error": "ImportError: x"}]))
    assert "bench gemm: ImportError: x" in r.why
    r = T.evaluate(SPEED, T.RunData([]))
    assert r.status == T.NOT_RUN and "no rows from bench gemm (not run)" in r.why
    r = T.evaluate(SPEED, T.RunData([_rec("gemm", "other", "A", "triton", 1.0)]))
    assert "no row 'fast'" in r.why
    # a whole section of a module that failed (attention's section error rows: shape "-")
    r = T.evaluate(SPEED, T.RunData([_rec("gemm", "_cuda_square_rows", "-", "-", float("nan"),
                                          extra={"error": "OOM"})]))
    assert "bench gemm _cuda_square_rows: error OOM" in r.why
    # the error row of this op comes first; another op's at the same shape and backend only without one
    other = _rec("gemm", "k_grouped", "A", "triton", float("nan"), extra={"error": "other op"})
    mine = _rec("gemm", "fast", "A", "triton", float("nan"), extra={"error": "this op"})
    assert "this op" in T.evaluate(SPEED, T.RunData([mine, other])).why
    assert "other op" in T.evaluate(SPEED, T.RunData([other])).why


def test_fastest_alternative_counts_and_worst_must_pass():
    fastest = T.RowTarget("23", "fp8", "moe", T.Sel("moe", ("block", "row")), ("S",), T.speedup, ">=", 1.3,
                          base=T.Sel("moe", ("base",)))
    rows = [_rec("moe", "moe", "S", "base", 2.0), _rec("moe", "moe", "S", "block", 1.8),
            _rec("moe", "moe", "S", "row", 1.5)]
    assert T.evaluate(fastest, T.RunData(rows)).measured == "1.33x"
    # one alternative failing: the other still counts
    rows[2] = _rec("moe", "moe", "S", "row", float("nan"), extra={"error": "x"})
    r = T.evaluate(fastest, T.RunData(rows))
    assert (r.status, r.why) == (T.MISS, "only block measured")
    mem = T.RowTarget("24", "mem", "lp", T.Sel("lp", ("a", "a+e")), ("S",), T.value_ratio("peak"), "<=", 1.25,
                      base=T.Sel("lp", ("liger",)), pick="worst")
    data = [_rec("lp", "lp", "S", "liger", 1.0, values={"peak": 100}),
            _rec("lp", "lp", "S", "a", 1.0, values={"peak": 110}),
            _rec("lp", "lp", "S", "a+e", 2.0, values={"peak": 130})]
    r = T.evaluate(mem, T.RunData(data))
    assert (r.status, r.measured) == (T.MISS, "1.30x")  # the worst of 1.10 and 1.30
    assert T.evaluate(mem, T.RunData(data[:2])).status == T.NOT_RUN  # each must be measured
    # the peak the fastest recipe needs, of the same row the speed target picked
    data[2]["values"] = {"peak": 120}
    assert T.evaluate(mem, T.RunData(data)).status == T.PASS


def test_time_ratio_own_ratio_tflops_and_reported_values():
    lower = T.RowTarget("24", "t", "lp", T.Sel("lp", ("p",)), ("S",), T.time_ratio, "<=", 1.0,
                        base=T.Sel("lp", ("liger",)))
    rows = [_rec("lp", "lp", "S", "liger", 2.0), _rec("lp", "lp", "S", "p", 1.9)]
    assert (T.evaluate(lower, T.RunData(rows)).status, T.evaluate(lower, T.RunData(rows)).measured) == (T.PASS, "0.95x")
    ring = T.RowTarget("24", "r", "att", T.Sel("ring", ("None",)), ("S",), T.own_ratio, ">=", 1 / 1.2)
    assert T.evaluate(ring, T.RunData([_rec("att", "ring", "S", "None", 1.0, ratio=0.8)])).status == T.MISS
    assert T.evaluate(ring, T.RunData([_rec("att", "ring", "S", "None", 1.0, ratio=0.85)])).status == T.PASS
    tf = T.RowTarget("23", "tf", "gemm", T.Sel("g", ("triton",)), ("S",), T.tflops, ">=", 1200.0, fmt="{:.0f}")
    r = T.evaluate(tf, T.RunData([_rec("gemm", "g", "S", "triton", 1.0, tflops=1100.0)]))
    assert (r.status, r.measured, r.threshold) == (T.MISS, "1100", ">= 1200")
    job = T.RowTarget("22", "steps/s", "job", T.JOB, (None,), T.value("steps_per_s"), "reported", fmt="{:.2f}")
    row = _rec("job", "rl_job", "reverse-text 32x8, 40 s", "cuda", 0.5, values={"steps_per_s": 2.0})
    r = T.evaluate(job, T.RunData([row]))
    assert (r.status, r.measured, r.threshold) == (T.PASS, "2.00", "reported")
    row["values"] = {}
    r = T.evaluate(job, T.RunData([row]))
    assert r.status == T.NOT_RUN and "values[steps_per_s]" in r.why
    dec = T.RowTarget("22", "dec", "runtime", T.Sel("decode", ("engine cuda",), dtype="bf16"), (None,),
                      T.value("tok_per_s"), "reported", fmt="{:.0f}")
    rows = [_rec("runtime", "decode", "x", "engine cuda", 1.0, dtype="fp32", values={"tok_per_s": 10.0}),
            _rec("runtime", "decode", "x", "engine cuda", float("nan"), dtype="bf16", extra={"error": "boom"})]
    r = T.evaluate(dec, T.RunData(rows))
    assert r.status == T.NOT_RUN and "boom" in r.why  # the float32 row is not taken for the bf16 one


def test_step_target_reads_the_scripts_total_time():
    t = T.StepTarget("22", "under 8 min", "total", 480.0)
    assert T.evaluate(t, T.RunData([_status("total", "-", 470)])).status == T.PASS
    assert T.evaluate(t, T.RunData([_status("total", "-", 500)])).status == T.MISS
    assert T.evaluate(t, T.RunData([])).status == T.NOT_RUN


def _junit(tmp_path) -> Path:
    """JUnit XML written by a real pytest run of a pass, a fail, a skip with a reason, a parametrized pass."""
    src = tmp_path / "src" / "test_gpu_job.py"
    src.parent.mkdir()
    src.write_text("import pytest\n"
                   "def test_ok(): pass\n"
                   "def test_bad(): assert 1 == 2, 'reward fell'\n"
                   "@pytest.mark.skipif(True, reason='needs 2 GPUs; 1 visible')\n"
                   "def test_two(): pass\n"
                   "@pytest.mark.parametrize('n', [1, 2])\n"
                   "def test_par(n): pass\n")
    out = tmp_path / "junit"
    out.mkdir()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(src), "-o", "addopts=",
                    f"--junitxml={out / 'runtime.xml'}", "--rootdir", str(src.parent)],
                   cwd=src.parent, capture_output=True, timeout=120)
    return out


def test_test_targets_from_a_real_junit_file(tmp_path):
    run = T.RunData([_status("pytest -m gpu tests/runtime", "FAIL(1)", 30)], T.read_junit(_junit(tmp_path)))
    names = ("test_ok", "test_bad", "test_two", "test_par", "test_gone")
    named = {n: T.TestTarget("22", n, (("test_gpu_job", n),), "tests/runtime") for n in names}
    assert T.evaluate(named["test_ok"], run).status == T.PASS
    assert T.evaluate(named["test_par"], run).status == T.PASS
    r = T.evaluate(named["test_bad"], run)
    assert r.status == T.MISS and "reward fell" in r.why
    r = T.evaluate(named["test_two"], run)
    assert r.status == T.NOT_RUN and "needs 2 GPUs; 1 visible" in r.why
    r = T.evaluate(named["test_gone"], run)
    assert r.status == T.NOT_RUN and "FAIL(1)" in r.why
    elsewhere = T.RunData([_status("pytest -m gpu tests/kernels", "TIMEOUT", 150)], run.cases)
    assert T.evaluate(named["test_gone"], elsewhere).why == "test_gpu_job::test_gone not in the JUnit results"
    r = T.evaluate(T.TestTarget("23,24", "all"), run)
    assert (r.status, r.measured) == (T.MISS, "3 passed, 1 failed, 1 skipped") and "test_gpu_job::test_bad" in r.why


def test_every_gpu_test_green_needs_every_folder_run():
    cases = [{"file": "test_a", "name": "t", "outcome": "passed", "message": ""}]
    ok = [_status("pytest -m gpu tests/kernels", "ok", 50), _status("pytest -m gpu tests/models", "-", 0)]
    t = T.TestTarget("23,24", "all")
    assert T.evaluate(t, T.RunData(ok, cases)).status == T.PASS
    r = T.evaluate(t, T.RunData(ok + [_status("pytest -m gpu tests/runtime", "TIMEOUT", 150)], cases))
    assert r.status == T.NOT_RUN and "tests/runtime TIMEOUT after 150 s" in r.why
    assert T.evaluate(t, T.RunData(ok, [])).status == T.NOT_RUN


def test_cli_prints_one_line_per_target(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(_status("bench gemm", "TIMEOUT", 90)) + "\n")
    assert T.main([str(path), str(tmp_path / "missing.jsonl"), "--junit", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 + len(T.TARGETS) + 1
    assert out[-1].startswith(f"0 PASS, 0 MISS, {len(T.TARGETS)} NOT RUN")
    # an error text over several lines (a log tail) stays on its target's line
    error_row = _rec("job", "rl_job", "x", "cuda", float("nan"), extra={"error": "failed:\nTraceback\n  x"})
    path.write_text(json.dumps(error_row) + "\n")
    T.main([str(path)])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 + len(T.TARGETS) + 1 and any("cuda: error failed: Traceback x" in line for line in out)


# ------------------------------------------------------------------------------ targets vs the modules' CUDA rows


def _no_call_time(*args, **kwargs):
    return 1e-3


_GENERATOR = torch.Generator


class _CpuGenerator(_GENERATOR):
    """``torch.Generator(device="cuda")`` on a CPU-only torch (the fake tensors take any generator)."""

    def __new__(cls, device=None):
        return _GENERATOR.__new__(cls)

    def __init__(self, device=None):
        super().__init__()


def _fake_metrics(steps=8):
    return [{"time/step_s": 0.5, "tokens": 4096, "time/train_s": 0.2, "inference/tokens_per_s": 9000.0,
             "reward/mean": 0.1 + 0.01 * i, "memory/trainer_peak_gb": 3.0, "memory/engine_peak_gb": 2.0}
            for i in range(steps)]


def _cuda_rows_of(module_name: str) -> list[Row]:
    """``bench.<module>.run`` with --device cuda on fake CUDA tensors: the rows it builds, with every
    timed function left uncalled (a case that still raises yields its error row, named the same)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import bench.harness as H
    import primerl.kernels.logprobs.chunked as chunked
    from primerl.kernels import gemm as G

    m = __import__(f"bench.{module_name}", fromlist=["run"])
    patches = [mock.patch.object(torch.cuda, n, lambda *a, **k: None)
               for n in ("synchronize", "empty_cache", "reset_peak_memory_stats")]
    patches += [mock.patch.object(torch.cuda, n, lambda *a, **k: 0)
                for n in ("memory_allocated", "max_memory_allocated")]
    patches += [mock.patch.object(torch, "Generator", _CpuGenerator),
                mock.patch.object(H, "peak_memory", lambda *a, **k: 1)]
    # the setup steps whose kernels cannot run on fake tensors (their results only feed timed lambdas):
    # Triton launches (the interpreter, as TRITON_INTERPRET=1 here) do nothing, a few helpers are inert
    import triton.runtime.interpreter as interpreter

    patches += [mock.patch.object(interpreter.GridExecutor, "__call__", lambda self, *a, **k: None),
                mock.patch.object(G, "pad_to_contiguous", lambda x, offs, *a, **k: (x, None, offs)),
                mock.patch.object(G, "quant_per_group_colwise", lambda *a, **k: None),
                mock.patch.object(chunked, "native_low_precision", lambda *a, **k: True)]
    own = {"time_fn": _no_call_time, "_do_bench": _no_call_time, "_cuda_measure": lambda *a, **k: (1e-3, 1000),
           "_liger_flce": lambda: None,
           "_experts_step": lambda *a, **k: (lambda: None),
           "_cu": lambda lens, device="cpu": torch.zeros(len(lens) + 1, dtype=torch.int32, device=device),
           "backend_status": lambda name: types.SimpleNamespace(available=True),  # DeepGEMM rows as if installed
           "run_job": lambda *a, **k: _fake_metrics(), "decode_rate": lambda *a, **k: (5000.0, 16384)}
    patches += [mock.patch.object(m, name, fn) for name, fn in own.items() if hasattr(m, name)]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        with FakeTensorMode(allow_non_fake_inputs=True):
            return m.run(types.SimpleNamespace(device="cuda", quick=False))


@pytest.fixture(scope="module")
def cuda_rows():
    modules = sorted({t.module for t in T.TARGETS if isinstance(t, T.RowTarget)})
    return {mod: _cuda_rows_of(mod) for mod in modules}


def test_every_target_reads_rows_the_modules_emit_on_cuda(cuda_rows):
    missing = []
    for t in T.TARGETS:
        if not isinstance(t, T.RowTarget):
            continue
        rows = cuda_rows[t.module]
        for sel in filter(None, (t.row, t.base)):
            for shape in t.shapes:
                for be in sel.backends:
                    if not any(r.op == sel.op and r.backend == be and (shape is None or r.shape == shape)
                               and (sel.dtype is None or r.dtype == sel.dtype) for r in rows):
                        missing.append((t.text, sel.op, be, shape))
    assert not missing, f"targets reading rows no module emits on CUDA: {missing}"


def test_targets_evaluate_on_the_modules_cuda_rows(cuda_rows):
    """The fake run's own rows (uniform 1 ms timings) carry every quantity a target reads: a target
    whose rows are all timed is PASS or MISS, never NOT RUN for a missing field."""
    recs = [json.loads(row_to_json(r, mod)) for mod, rows in cuda_rows.items() for r in rows]
    run = T.RunData(recs)
    for t in T.TARGETS:
        if not isinstance(t, T.RowTarget):
            continue
        r = T.evaluate(t, run)
        assert "rows lack" not in r.why, (t.text, r.why)
        if t.module in ("moe", "logprobs", "job", "runtime"):  # their fake runs time every row
            assert r.status in (T.PASS, T.MISS), (t.text, r)
