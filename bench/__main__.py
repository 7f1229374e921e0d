"""python -m bench <op> [--quick] [--device cpu|cuda] [--json PATH]: print a benchmark table for one op
family; with --json also append each row to PATH as one JSON line (bench/targets.py reads them)."""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import signal
import sys
from pathlib import Path

from . import harness
from .harness import format_table, header, row_to_json

_NOT_OPS = {"harness", "cpu_memory", "targets", "__main__"}


def available_ops() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)])
                  if m.name not in _NOT_OPS and not m.name.startswith("_"))


class _Stopped(BaseException):
    """SIGTERM while a module runs (a BaseException: the modules' ``except Exception`` let it through)."""


def _stop(signum, frame):
    raise _Stopped()


def _append(path: str, lines: list[str]) -> None:
    with open(path, "a") as f:
        f.writelines(line + "\n" for line in lines)


def main(argv=None) -> int:
    ops = available_ops()
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("op", choices=ops + ["all"])
    parser.add_argument("--quick", action="store_true", help="small shapes / few repeats (CI smoke run)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="append every row to PATH as a JSON line (and a module that raises as an error record)")
    args = parser.parse_args(argv)
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    print(header())
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return _run_ops(ops if args.op == "all" else [args.op], args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_ops(ops: list[str], args) -> int:
    for op in ops:
        stopped = None
        harness._made_rows = []
        try:
            module = importlib.import_module(f"bench.{op}")
            rows = module.run(args)
        except _Stopped:  # cut off at a time limit: the rows finished so far, then exit as timed out
            rows = list(harness._made_rows)
            stopped = f"stopped by SIGTERM (a time limit) after {len(rows)} rows; the rest not measured"
        except BaseException as exc:  # a module that dies: say so in the JSON too, then fail as before
            if args.json:
                _append(args.json, [json.dumps({"kind": "module_error", "module": op,
                                                "error": f"{type(exc).__name__}: {str(exc)[:300]}"})])
            raise
        finally:
            harness._made_rows = None
        if args.json:
            _append(args.json, [row_to_json(r, op) for r in rows]
                    + ([json.dumps({"kind": "module_error", "module": op, "error": stopped})] if stopped else []))
        print(f"\n## {op}" + (f" ({stopped})" if stopped else ""))
        # a module whose rows are not timings (e.g. aot) brings its own table
        print((format_table if stopped else getattr(module, "format_table", format_table))(rows))
        sys.stdout.flush()
        if stopped:
            return 124
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
