"""python -m bench <op> [--quick] [--device cpu|cuda]: print a benchmark table for one op family."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

from .harness import format_table, header

_NOT_OPS = {"harness", "cpu_memory", "__main__"}


def available_ops() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.name not in _NOT_OPS and not m.name.startswith("_"))


def main(argv=None) -> int:
    ops = available_ops()
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("op", choices=ops + ["all"])
    parser.add_argument("--quick", action="store_true", help="small shapes / few repeats (CI smoke run)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    args = parser.parse_args(argv)
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    print(header())
    for op in ops if args.op == "all" else [args.op]:
        module = importlib.import_module(f"bench.{op}")
        rows = module.run(args)
        print(f"\n## {op}")
        # a module whose rows are not timings (e.g. aot) brings its own table
        print(getattr(module, "format_table", format_table)(rows))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
