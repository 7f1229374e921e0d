"""Ahead-of-time compile report: every Triton kernel of primerl.kernels compiled for sm_90a
(H100/H200) and sm_100a (B200) at the launch configuration the package picks there, on any
machine (no GPU needed). Columns: the structure (``tile``: block shape, warps, stages; ``TMA``:
UTMALDG/UBLKCP instructions in the SASS; ``maxreg``: SETMAXNREG/USETMAXREG, i.e. warp-specialized
register reallocation; ``pers``: a persistent grid), registers per thread, spills (local
loads/stores in the SASS), dynamic shared memory, the MMA opcodes in the SASS, and the checker's
verdict (:func:`primerl.kernels.aot.problems`). ``--quick`` compiles the test suite's subset.
"""

from __future__ import annotations

from primerl.kernels import aot


def run(args) -> list[aot.Report]:
    return aot.compile_reports(aot.CI_ARCHS, subset="ci" if args.quick else "all")


def format_table(reports: list[aot.Report]) -> str:
    bad = sum(1 for r in reports if aot.problems(r))
    return aot.format_reports(reports) + f"\n{len(reports)} kernels compiled, {bad} flagged"
