"""The GPU-measured done-when targets of issues 22-24, evaluated from one GPU check's data.

    python -m bench.targets ROWS.jsonl [--junit DIR]

``ROWS.jsonl`` holds the rows ``python -m bench <op> --json ROWS.jsonl`` appended (one JSON object
per Row, ``kind: "row"``; ``kind: "module_error"`` for a module that raised) and the step records
bench/gpu_check.sh appends (``kind: "status"``: step, status ok / TIMEOUT / FAIL(rc) / skipped,
seconds, detail; step ``"total"`` carries the script's time so far). ``DIR`` holds the JUnit XML
files of the ``pytest -m gpu`` runs.

Each target names the rows it reads (bench module, op, backend; the shapes exactly as the module
writes them, in the issue's table order) and the baseline row of the same shape, computes its
figure per shape, and says PASS, MISS (a measured value misses the threshold), or NOT RUN with why
(an error row, a module cut off by its time limit or by the script's budget, a test skipped).
Targets that only ask for a figure to be printed (the RL job's) have threshold "reported".
Done-when items that no GPU run measures (CPU tests, AOT tables, RESULTS.md) are not listed.
"""

from __future__ import annotations

import argparse
import math
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .harness import Row, read_jsonl, row_from_json

PASS, MISS, NOT_RUN = "PASS", "MISS", "NOT RUN"
_OK_STEP = {"ok", "-"}  # "-": nothing to run there (e.g. a test folder without gpu-marked tests)


# ------------------------------------------------------------------------------ what a target reads


def speedup(row: Row, base: Row) -> float:
    """baseline time / this time (> 1 = faster than the baseline)."""
    return base.median_s / row.median_s


def time_ratio(row: Row, base: Row) -> float:
    """this time / baseline time (< 1 = faster than the baseline)."""
    return row.median_s / base.median_s


def own_ratio(row: Row, base: Row | None) -> float:
    """the row's own ``ratio`` (its baseline is no row of its own, e.g. the ring step's square kernel)."""
    return row.ratio


def tflops(row: Row, base: Row | None) -> float:
    return row.tflops


def value(key: str) -> Callable[[Row, Row | None], float]:
    def fn(row, base):
        return row.values[key]

    fn.__name__ = f"values[{key}]"
    return fn


def value_ratio(key: str) -> Callable[[Row, Row], float]:
    def fn(row, base):
        return row.values[key] / base.values[key]

    fn.__name__ = f"values[{key}] / baseline's"
    return fn


@dataclass(frozen=True)
class Sel:
    """Rows of one op: ``backends`` are alternatives (the target's ``pick`` says which counts)."""

    op: str
    backends: tuple[str, ...]
    dtype: str | None = None  # where the backend alone does not tell the rows apart


@dataclass(frozen=True)
class RowTarget:
    issue: str
    text: str
    module: str
    row: Sel
    shapes: tuple[str | None, ...]  # None: any shape (the job's shape names its run time)
    measure: Callable[[Row, Row | None], float]
    cmp: str  # ">=", "<=" or "reported" (any finite value)
    threshold: float = math.nan
    base: Sel | None = None
    pick: str = "fastest"  # several row backends: the "fastest" one counts, or the "worst" value (all must pass)
    fmt: str = "{:.2f}x"


@dataclass(frozen=True)
class TestTarget:
    issue: str
    text: str
    tests: tuple[tuple[str, str], ...] = ()  # (file stem, test name); () = every gpu-marked test
    folder: str = "tests/"  # the pytest step(s) whose failure to run explains a missing result


@dataclass(frozen=True)
class StepTarget:
    issue: str
    text: str
    step: str
    max_seconds: float


Target = RowTarget | TestTarget | StepTarget

# ------------------------------------------------------------------------------ the targets

DENSE = ("4096x7168x16384", "4096x4096x7168", "4096x2112x7168", "4096x24576x1536", "4096x7168x2048", "128x7168x2048")
CONTIGUOUS = ("4x8192 N4096 K7168", "8x4096 N7168 K2048", "32x256 N4096 K7168")
K_GROUPED = ("4x8192 N4096 K7168",)
MASKED = ("1x1024 N4096 K7168", "4x256 N4096 K7168")
MOE = ("T=8192 D=5120 I=1536 E=20 k=8", "T=16384 D=6144 I=2048 E=32 k=8", "T=4096 D=2048 I=768 E=64 k=8")
LOGPROBS = ("T=16384 D=4096 V=151936", "T=32768 D=6144 V=154880")
ATTENTION = ("8x4096 H=32/8 D=128 causal", "1x32768 H=32/8 D=128 causal", "16x2048 H=64/8 D=128 causal")
RING_STEP = ("4096 q x 8192 k H=32/8 D=128 causal",)
FP8_RECIPES = ("primerl_fp8_blockwise", "primerl_fp8_rowwise")
JOB = Sel("rl_job", ("cuda",))

TARGETS: list[Target] = [
    StepTarget("22", "bench/gpu_check.sh whole script under 8 minutes", "total", 480.0),
    TestTarget("22", "1-GPU job >= 20 steps on the GPU, reward rises (gpu test)",
               (("test_gpu_job", "test_one_gpu_job_trains_on_the_gpu"),), "tests/runtime"),
    TestTarget("22", "2-GPU layout, engine on its own GPU (gpu test)",
               (("test_gpu_job", "test_two_gpu_layout_puts_the_engine_on_its_own_gpu"),), "tests/runtime"),
    TestTarget("22", "2-rank NCCL trainer matches one process (gpu test)",
               (("test_gpu_job", "test_two_nccl_trainer_ranks_match_one_process"),), "tests/runtime"),
    RowTarget("22", "GPU example job: steps/s", "job", JOB, (None,), value("steps_per_s"), "reported", fmt="{:.2f}"),
    RowTarget("22", "GPU example job: trainer tokens/s", "job", JOB, (None,), value("trainer_tok_per_s"), "reported",
              fmt="{:.0f}"),
    RowTarget("22", "GPU example job: engine decode tokens/s", "job", JOB, (None,), value("engine_tok_per_s"),
              "reported", fmt="{:.0f}"),
    RowTarget("22", "engine alone: decode tokens/s, bf16 (bench runtime)", "runtime",
              Sel("decode", ("engine cuda",), dtype="bf16"), (None,), value("tok_per_s"), "reported", fmt="{:.0f}"),
    RowTarget("22", "GPU example job: trainer peak GPU memory (GB)", "job", JOB, (None,), value("trainer_peak_gb"),
              "reported", fmt="{:.2f}"),
    RowTarget("22", "GPU example job: engine peak GPU memory (GB)", "job", JOB, (None,), value("engine_peak_gb"),
              "reported", fmt="{:.2f}"),
    RowTarget("22", "GPU example job: reward, mean of the last 10 steps", "job", JOB, (None,), value("reward_last10"),
              "reported", fmt="{:.3f}"),
    RowTarget("23", "dense FP8 backend=None vs cuBLAS blockwise, 6 shapes", "gemm", Sel("fp8_gemm_nt", ("None",)),
              DENSE, speedup, ">=", 1.0, base=Sel("scaled_mm_blockwise", ("cublas",))),
    RowTarget("23", "dense FP8 backend=None vs cuBLAS bf16 at M = 128", "gemm", Sel("fp8_gemm_nt", ("None",)),
              DENSE[-1:], speedup, ">=", 1.0, base=Sel("bf16_mm", ("cublas",))),
    RowTarget("23", "m-grouped contiguous FP8 vs bf16 _grouped_mm, 3 shapes", "gemm",
              Sel("m_grouped_fp8_contiguous", ("triton",)), CONTIGUOUS, speedup, ">=", 1.4,
              base=Sel("bf16_grouped_mm", ("torch",))),
    RowTarget("23", "stretch: m-grouped contiguous FP8 TF/s at 4x8192", "gemm",
              Sel("m_grouped_fp8_contiguous", ("triton",)), CONTIGUOUS[:1], tflops, ">=", 1200.0, fmt="{:.0f}"),
    RowTarget("23", "stretch: m-grouped contiguous FP8 vs DeepGEMM at 4x8192", "gemm",
              Sel("m_grouped_fp8_contiguous", ("triton",)), CONTIGUOUS[:1], speedup, ">=", 0.9,
              base=Sel("m_grouped_fp8_contiguous", ("deep_gemm",))),
    RowTarget("23", "k-grouped FP8 wgrad vs bf16 wgrad _grouped_mm", "gemm", Sel("k_grouped_fp8_tn", ("triton",)),
              K_GROUPED, speedup, ">=", 1.2, base=Sel("bf16_k_grouped_mm", ("torch",))),
    RowTarget("23", "masked FP8 vs bf16 bmm, 2 shapes", "gemm", Sel("m_grouped_fp8_masked", ("triton",)), MASKED,
              speedup, ">=", 1.2, base=Sel("bf16_bmm", ("torch",))),
    RowTarget("23", "MoE fwd+bwd: FP8 (faster recipe) vs torchtitan bf16, first 2 shapes", "moe",
              Sel("moe_experts_fwd_bwd", FP8_RECIPES), MOE[:2], speedup, ">=", 1.3,
              base=Sel("moe_experts_fwd_bwd", ("torchtitan_baseline",))),
    RowTarget("23", "MoE fwd+bwd: primerl bf16 vs torchtitan bf16, 3 shapes", "moe",
              Sel("moe_experts_fwd_bwd", ("primerl_bf16",)), MOE, speedup, ">=", 1.1,
              base=Sel("moe_experts_fwd_bwd", ("torchtitan_baseline",))),
    RowTarget("23", "MoE fwd+bwd: FP8 (faster recipe) peak memory / primerl bf16's", "moe",
              Sel("moe_experts_fwd_bwd", FP8_RECIPES), MOE, value_ratio("peak_bytes"), "<=", 1.0,
              base=Sel("moe_experts_fwd_bwd", ("primerl_bf16",))),
    TestTarget("23,24", "every gpu-marked test green (numerics included)"),
    RowTarget("24", "fused_logprobs fwd+bwd time / Liger FLCE's, 2 shapes", "logprobs",
              Sel("logprobs fwd+bwd", ("primerl",)), LOGPROBS, time_ratio, "<=", 1.0,
              base=Sel("logprobs fwd+bwd", ("liger",))),
    RowTarget("24", "fused_logprobs entropy on / off time", "logprobs", Sel("logprobs fwd+bwd", ("primerl+entropy",)),
              LOGPROBS, time_ratio, "<=", 1.15, base=Sel("logprobs fwd+bwd", ("primerl",))),
    RowTarget("24", "fused_logprobs peak extra memory / Liger's (entropy off and on)", "logprobs",
              Sel("logprobs fwd+bwd", ("primerl", "primerl+entropy")), LOGPROBS, value_ratio("peak_extra_bytes"), "<=",
              1.25, base=Sel("logprobs fwd+bwd", ("liger",)), pick="worst"),
    RowTarget("24", "attention fwd, backend=None vs SDPA, 3 shapes", "attention",
              Sel("attention fwd", ("primerl None",)), ATTENTION, speedup, ">=", 0.9,
              base=Sel("attention fwd", ("sdpa",))),
    RowTarget("24", "attention fwd+bwd, backend=None vs SDPA, 3 shapes", "attention",
              Sel("attention fwd+bwd", ("primerl None",)), ATTENTION, speedup, ">=", 0.9,
              base=Sel("attention fwd+bwd", ("sdpa",))),
    RowTarget("24", "ring step fwd (positions) TF/s / square kernel's (within 1.2x)", "attention",
              Sel("ring step fwd", ("None, positions",)), RING_STEP, own_ratio, ">=", 1 / 1.2),
    RowTarget("24", "ring step fwd+bwd (positions) TF/s / square kernel's (within 1.2x)", "attention",
              Sel("ring step fwd+bwd", ("None, positions",)), RING_STEP, own_ratio, ">=", 1 / 1.2),
]


# ------------------------------------------------------------------------------ one run's data


@dataclass
class Result:
    status: str
    measured: str
    threshold: str
    why: str = ""


class RunData:
    """The records of one GPU check: bench rows, module errors, step statuses, JUnit test cases."""

    def __init__(self, records: list[dict], cases: list[dict] | None = None):
        self.rows: list[tuple[str, Row]] = [(r["module"], row_from_json(r)) for r in records if r.get("kind") == "row"]
        self.module_errors = {r["module"]: r.get("error", "") for r in records if r.get("kind") == "module_error"}
        self.steps = {r["step"]: r for r in records if r.get("kind") == "status"}
        self.cases = cases or []

    @classmethod
    def load(cls, paths: list[str | Path], junit_dir: str | Path | None = None) -> RunData:
        records = []
        for p in paths:
            if Path(p).exists():
                records += read_jsonl(p)
        return cls(records, read_junit(junit_dir) if junit_dir else [])

    def find(self, module: str, op: str, shape: str | None, backend: str, dtype: str | None = None) -> Row | None:
        """The last row of that name (a module run twice: its latest)."""
        hit = None
        for mod, r in self.rows:
            if (mod == module and r.op == op and r.backend == backend and (shape is None or r.shape == shape)
                    and (dtype is None or r.dtype == dtype)):
                hit = r
        return hit

    def why_missing(self, module: str, sel: Sel, shape: str | None) -> str:
        for same_op in (True, False):  # an error row of this case (of another op: attention prints a
            for mod, r in reversed(self.rows):  # failing backend's error once, as its "fwd" row)
                if (mod == module and r.backend in sel.backends and (shape is None or r.shape == shape)
                        and (r.op == sel.op or not same_op) and _failure(r)):
                    return f"{r.backend}: {_failure(r)}"
        for mod, r in reversed(self.rows):  # a section of the module that failed as a whole
            if mod == module and r.shape == "-" and _failure(r):
                return f"bench {module} {r.op}: {_failure(r)}"
        if module in self.module_errors:
            return f"bench {module}: {self.module_errors[module]}"
        step = self.steps.get(f"bench {module}")
        if step is not None and step.get("status") not in _OK_STEP:
            return _step_text(step)
        if not any(mod == module for mod, _ in self.rows):
            return f"no rows from bench {module}" + ("" if step else " (not run)")
        return f"no row {sel.op!r} / {'|'.join(sel.backends)!r}" + (f" at {shape!r}" if shape else "")


def _failure(row: Row) -> str:
    if row.extra.get("error"):
        return f"error {str(row.extra['error'])[:120]}"
    if row.extra.get("skipped"):
        return f"skipped: {row.extra['skipped']}"
    if row.median_s is None or not math.isfinite(row.median_s):
        return "not timed"
    return ""


def _step_text(step: dict) -> str:
    text = f"{step['step']} {step.get('status')}"
    if step.get("seconds"):
        text += f" after {step['seconds']} s"
    return text + (f" ({step['detail']})" if step.get("detail") else "")


def read_junit(directory: str | Path) -> list[dict]:
    """Every test case of the JUnit XML files in ``directory``: file stem, name, outcome, message."""
    cases = []
    for path in sorted(Path(directory).glob("*.xml")):
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError:
            continue  # a pytest killed while writing it: its step record says TIMEOUT
        for tc in root.iter("testcase"):
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = tc.find(tag)
                if el is not None:
                    outcome, message = ("failed" if tag != "skipped" else "skipped"), el.get("message", "")
                    break
            cases.append({"file": tc.get("classname", "").rsplit(".", 1)[-1], "name": tc.get("name", ""),
                          "outcome": outcome, "message": message})
    return cases


# ------------------------------------------------------------------------------ evaluation


def _passes(v: float, cmp: str, threshold: float) -> bool:
    if cmp == "reported":
        return math.isfinite(v)
    return v >= threshold if cmp == ">=" else v <= threshold


def _threshold_text(t: RowTarget) -> str:
    if t.cmp == "reported":
        return "reported"
    return f"{t.cmp} {t.fmt.format(t.threshold)}"


def _valid(row: Row | None) -> bool:
    return row is not None and not _failure(row)


def _one_shape(t: RowTarget, run: RunData, shape: str | None) -> tuple[str, float | None, str]:
    rows = [run.find(t.module, t.row.op, shape, be, t.row.dtype) for be in t.row.backends]
    valid = [r for r in rows if _valid(r)]
    if not valid or (t.pick == "worst" and len(valid) < len(rows)):
        return NOT_RUN, None, run.why_missing(t.module, t.row, shape)
    base = None
    if t.base is not None:
        bases = [run.find(t.module, t.base.op, shape, be, t.base.dtype) for be in t.base.backends]
        bases = [b for b in bases if _valid(b)]
        if not bases:
            return NOT_RUN, None, "baseline " + run.why_missing(t.module, t.base, shape)
        base = min(bases, key=lambda b: b.median_s)
    note = ""
    if t.pick == "fastest":
        if len(valid) < len(rows):  # the fastest of those measured: say which were not
            note = "only " + ", ".join(r.backend for r in valid) + " measured"
        valid = [min(valid, key=lambda r: r.median_s)]
    try:
        vals = [float(t.measure(r, base)) for r in valid]
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        return NOT_RUN, None, f"rows lack {t.measure.__name__} ({type(exc).__name__}: {exc})"
    v = min(vals) if t.cmp == ">=" else max(vals)  # the worst when each must pass
    if not math.isfinite(v):
        return NOT_RUN, None, f"{t.measure.__name__} is not finite"
    return (PASS if _passes(v, t.cmp, t.threshold) else MISS), v, note


def _evaluate_rows(t: RowTarget, run: RunData) -> Result:
    per = [(shape, *_one_shape(t, run, shape)) for shape in t.shapes]
    statuses = [s for _, s, _, _ in per]
    measured = " ".join("-" if v is None else t.fmt.format(v) for _, _, v, _ in per)
    noted = [(shape, why) for shape, _, _, why in per if why]
    if len({why for _, why in noted}) <= 1:  # one reason for all (e.g. the module did not run): said once
        whys = [why for _, why in noted[:1]]
    else:
        whys = [f"{shape}: {why}" for shape, why in noted]
    if MISS in statuses:
        status = MISS
        if NOT_RUN in statuses:
            whys.insert(0, f"{statuses.count(NOT_RUN)} of {len(statuses)} not run")
    elif NOT_RUN in statuses:
        status = NOT_RUN
    else:
        status = PASS
    return Result(status, measured, _threshold_text(t), "; ".join(whys))


def _pytest_steps_not_done(run: RunData, folder: str = "tests/") -> list[str]:
    return [_step_text(s) for name, s in run.steps.items()
            if name.startswith(f"pytest -m gpu {folder}") and s.get("status") not in _OK_STEP]


def _evaluate_tests(t: TestTarget, run: RunData) -> Result:
    if not t.tests:
        failed = [c for c in run.cases if c["outcome"] == "failed"]
        passed = sum(c["outcome"] == "passed" for c in run.cases)
        skipped = sum(c["outcome"] == "skipped" for c in run.cases)
        measured = f"{passed} passed, {len(failed)} failed, {skipped} skipped"
        if failed:
            return Result(MISS, measured, "0 failed", ", ".join(f"{c['file']}::{c['name']}" for c in failed[:3]))
        not_done = _pytest_steps_not_done(run)
        if not_done or not run.cases:
            return Result(NOT_RUN, measured, "0 failed", "; ".join(not_done) or "no JUnit results")
        return Result(PASS, measured, "0 failed")
    outcomes = []
    for stem, name in t.tests:
        hits = [c for c in run.cases if c["file"] == stem and (c["name"] == name or c["name"].startswith(name + "["))]
        if not hits:
            outcomes.append((NOT_RUN, "-", "; ".join(_pytest_steps_not_done(run, t.folder))
                             or f"{stem}::{name} not in the JUnit results"))
        elif any(c["outcome"] == "failed" for c in hits):
            msg = next(c["message"] for c in hits if c["outcome"] == "failed")
            outcomes.append((MISS, "failed", msg[:120]))
        elif any(c["outcome"] == "skipped" for c in hits):
            msg = next(c["message"] for c in hits if c["outcome"] == "skipped")
            outcomes.append((NOT_RUN, "skipped", msg[:120]))
        else:
            outcomes.append((PASS, "passed", ""))
    if any(o[0] == MISS for o in outcomes):
        status = MISS
    else:
        status = NOT_RUN if any(o[0] == NOT_RUN for o in outcomes) else PASS
    return Result(status, " ".join(o[1] for o in outcomes), "passed", "; ".join(o[2] for o in outcomes if o[2]))


def _evaluate_step(t: StepTarget, run: RunData) -> Result:
    step = run.steps.get(t.step)
    threshold = f"<= {t.max_seconds:.0f} s"
    if step is None or step.get("seconds") is None:
        return Result(NOT_RUN, "-", threshold, f"no {t.step!r} step record")
    s = float(step["seconds"])
    return Result(PASS if s <= t.max_seconds else MISS, f"{s:.0f} s", threshold)


def evaluate(target: Target, run: RunData) -> Result:
    if isinstance(target, RowTarget):
        return _evaluate_rows(target, run)
    if isinstance(target, TestTarget):
        return _evaluate_tests(target, run)
    return _evaluate_step(target, run)


def format_targets(targets: list[Target], run: RunData) -> str:
    cols = ["issue", "target", "measured", "threshold", "status", "why"]
    data = []
    for t in targets:
        r = evaluate(t, run)
        data.append([t.issue, t.text, r.measured, r.threshold, r.status, " ".join(r.why.split())[:160]])
    widths = [max(len(c), *(len(d[i]) for d in data)) for i, c in enumerate(cols[:-1])]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths + [0])).rstrip(),
             "-+-".join("-" * w for w in widths + [3])]
    lines += [" | ".join(str(v).ljust(w) for v, w in zip(d, widths + [0])).rstrip() for d in data]
    counts = {s: sum(d[4] == s for d in data) for s in (PASS, MISS, NOT_RUN)}
    lines.append(f"{counts[PASS]} PASS, {counts[MISS]} MISS, {counts[NOT_RUN]} NOT RUN "
                 "(values per shape in the issue's table order; ratios from rows of the same run)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.targets", description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="+", help="JSON-lines files of bench rows and step records")
    parser.add_argument("--junit", default=None, help="folder of the pytest -m gpu JUnit XML files")
    args = parser.parse_args(argv)
    print(format_targets(TARGETS, RunData.load(args.rows, args.junit)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
