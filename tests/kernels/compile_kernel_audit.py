"""Graph breaks (torch._dynamo.explain) and host reads (count_host_reads) per op of the kernel cases.

    PYTHONPATH=$PWD python tests/kernels/compile_kernel_audit.py [name-substring ...]

Prints a markdown table: graph breaks of the forward, host reads of eager forward + backward with
debug value checks off, and whether fullgraph aot_eager (forward + backward) and FakeTensorMode
run. Used for the before/after table of issue 36 (bench/RESULTS.md, 2026-12-05).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import primerl.kernels as K  # noqa: E402
from primerl.kernels.testing import count_host_reads  # noqa: E402
from compile_kernel_cases import all_cases, float_outputs  # noqa: E402


def _loss(result):
    outs = float_outputs(result)
    return sum((o.float() * torch.linspace(0.5, 1.5, o.numel()).view(o.shape)).sum() for o in outs) if outs else None


def _run_fwd_bwd(fn, inputs):
    res = fn(*inputs)
    loss = _loss(res)
    if loss is not None:
        loss.backward()
    return res


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}" if str(exc) else type(exc).__name__


def audit(name, fn, make, grad):
    row = {"op": name}
    inputs = make(0)
    torch._dynamo.reset()
    try:
        ex = torch._dynamo.explain(fn)(*make(0))
        row["breaks"] = ex.graph_break_count
        row["why"] = "; ".join(sorted({str(b.reason).splitlines()[0][:60] for b in ex.break_reasons}))[:150]
    except Exception as exc:  # noqa: BLE001
        row["breaks"] = "err"
        row["why"] = _short(exc)
    with K.debug_checks(False):
        with count_host_reads() as c:
            try:
                _run_fwd_bwd(fn, make(0))
            except Exception as exc:  # noqa: BLE001
                row["why"] += " | eager: " + _short(exc)
        row["host_reads"] = c.total
        torch._dynamo.reset()
        try:
            _run_fwd_bwd(torch.compile(fn, backend="aot_eager", fullgraph=True), make(0))
            row["fullgraph"] = "ok"
        except Exception as exc:  # noqa: BLE001
            row["fullgraph"] = "FAIL"
            row.setdefault("why", "")
            if row["breaks"] == 0:
                row["why"] += " | fullgraph: " + _short(exc)
        try:
            with FakeTensorMode(allow_non_fake_inputs=False) as mode:
                fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in make(0)]
                for f, t in zip(fake, make(0)):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        f.requires_grad_(True)
                _run_fwd_bwd(fn, fake)
            row["fake"] = "ok"
        except Exception as exc:  # noqa: BLE001
            row["fake"] = "FAIL " + _short(exc)[:50]
    del inputs
    return row


def main(filters):
    rows = []
    for case in all_cases():
        if filters and not any(f in case[0] for f in filters):
            continue
        row = audit(*case)
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    print("| op | graph breaks (fwd) | host reads (eager fwd+bwd) | fullgraph aot_eager fwd+bwd | FakeTensorMode |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['breaks']} | {r['host_reads']} | {r['fullgraph']} | {r['fake']} |")
    print()
    for r in rows:
        if r.get("why"):
            print(f"- {r['op']}: {r['why']}")


if __name__ == "__main__":
    main(sys.argv[1:])
