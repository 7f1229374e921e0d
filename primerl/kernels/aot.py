"""Ahead-of-time compilation of the package's Triton kernels for Hopper (sm_90a) and Blackwell
(sm_100a) on a machine without a GPU, and what the compiled code says about each kernel:
registers, spills, shared memory, the tensor-core instruction, and the structure of a fast Hopper
kernel (TMA loads, warp-specialized register reallocation, a persistent grid, the tile shape).

Launch configurations are the package's own: each case (:mod:`.aot_cases`) calls a public op
(``backend="triton"``) or a Triton launcher at a representative shape on storage-less tensors
that report device cuda (meta tensors: shape, dtype and strides), while ``JITFunction.run``
records the launch instead of running it and the SM count is the target card's. So the tile
table, warps and stages are what a call on that GPU would use; pointer alignment is specialised
from the tensors' storage offsets as Triton does at launch. Each distinct specialisation is
compiled once per target with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``;
the wheel's ``cuobjdump`` reads the cubin (``--dump-resource-usage`` and ``-sass``).

What counts as a problem (:func:`problems`): the compile fails; any local-memory load or store in
the SASS (``LDL``/``STL``: register spills) or a stack frame; dynamic shared memory over the
card's 227 KB per block; a case that declares a tensor-core path without it in the SASS (FP8:
``QGMMA`` on sm_90a, ``UTCQMMA`` on sm_100a; 16-bit: ``HGMMA`` / ``UTCHMMA``; sm_100a also needs
``tcgen05.mma`` in the PTX), or with a pre-Hopper ``mma.sync`` (``HMMA``/``QMMA``) beside it.

Compiling needs Triton's compiled mode: the interpreter (``TRITON_INTERPRET=1``) replaces every
``@triton.jit`` function at import, so :func:`compile_reports` then runs the work in a fresh
interpreter-free subprocess. Command line: ``python -m primerl.kernels.aot [--arch sm_90a,sm_100a]
[--subset ci|all] [--extra FILE.py] [--jobs N] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from .aot_case import Case

SHARED_LIMIT_BYTES = 227 * 1024  # per block, opt-in maximum on H100/H200 and B200


@dataclass(frozen=True)
class Target:
    arch: str  # "sm_90a"
    capability: int  # 90
    num_sms: int  # of the card the launch configuration is picked for
    card: str


TARGETS = {
    "sm_90a": Target("sm_90a", 90, 132, "H100/H200 SXM"),
    "sm_100a": Target("sm_100a", 100, 148, "B200"),
}
CI_ARCHS = ("sm_90a", "sm_100a")


def in_ci_subset(case: Case, arch: str) -> bool:
    """The test suite's subset: cases marked ``ci``, on sm_100a only those with a dot (what
    Blackwell changes is the tensor-core path; the rest compiles alike on both, see RESULTS)."""
    return case.ci and (TARGETS[arch].capability < 100 or case.mma is not None)


# The tensor-core instruction a case declares (None: no dot) and what it must compile to.
_MMA_SASS = {("fp8", 90): "QGMMA", ("bf16", 90): "HGMMA", ("fp8", 100): "UTCQMMA", ("bf16", 100): "UTCHMMA"}
_LEGACY_MMA = ("HMMA", "QMMA")  # mma.sync: what a dot falls back to without wgmma / tcgen05


@dataclass
class Launch:
    case: Case
    fn: object  # triton JITFunction
    args: tuple
    kwargs: dict


@dataclass
class Report:
    kernel: str
    case: str
    target: str
    config: str
    expected_mma: str | None
    regs: int | None = None
    spill_ops: int | None = None  # LDL + STL instructions in the SASS
    stack_bytes: int | None = None
    shared_bytes: int | None = None
    mma: list[str] = dataclasses.field(default_factory=list)  # MMA-family SASS opcodes seen
    tma_loads: int | None = None  # UTMALDG (tensor TMA) + UBLKCP (bulk copy) instructions in the SASS
    setmaxnreg: int | None = None  # SETMAXNREG / USETMAXREG: register reallocation between warpgroups
    persistent: bool | None = None  # the kernel loops over tiles with a stride of its program count
    wgmma_serialized: bool | None = None  # ptxas serialized the warpgroup MMAs (its C7514 note)
    tile: str = ""  # BMxBNxBK (BNxBKxBT for the k-grouped kernel), warps, stages
    tcgen05_ptx: bool = False
    compile_s: float = 0.0
    error: str | None = None
    also_cases: list[str] = dataclasses.field(default_factory=list)  # same specialisation, later cases


# ------------------------------------------------------------------------------ capturing launches


class _StorageOffsetPointer:
    """What Triton's launch-time specialisation sees of a tensor: dtype and pointer alignment (a
    CUDA allocation is 256-byte aligned; a view is off by its storage offset)."""

    def __init__(self, t: torch.Tensor):
        self.dtype = t.dtype
        self._ptr = (1 << 20) + t.storage_offset() * t.element_size()

    def data_ptr(self) -> int:
        return self._ptr


class _MetaAsCuda(torch.overrides.TorchFunctionMode):
    """Tensors asked for on "cuda" live on "meta" (shape, dtype and strides, no storage; every view
    and op works) but report ``device`` cuda, so launchers take their GPU branches."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is torch.Tensor.device:
            device = func(*args, **kwargs)
            return torch.device("cuda") if device.type == "meta" else device
        if owner is torch.Tensor.is_cuda:
            return func(*args, **kwargs) or torch.Tensor.device.__get__(args[0]).type == "meta"
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = torch.device("meta")
        return func(*args, **kwargs)


@contextlib.contextmanager
def capture_launches(target: Target):
    """Within the block, Triton launches are recorded (not run) into the yielded list, tensors made
    with ``device="cuda"`` are storage-less (meta) stand-ins that report cuda, and the package's
    SM count and architecture are the target card's."""
    from triton.runtime.jit import JITFunction

    from . import _backend
    from .gemm import triton_common as gemm_common

    if _backend.triton_interpreter_enabled():
        raise RuntimeError("aot.capture_launches: TRITON_INTERPRET=1 replaces every @triton.jit kernel; "
                           "run in a process without it (compile_reports does)")
    launches: list[tuple] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    saved = JITFunction.run, gemm_common.num_sms, gemm_common.arch_major, _backend._triton_status
    JITFunction.run, gemm_common.num_sms = record, lambda: target.num_sms
    gemm_common.arch_major = lambda: target.capability // 10
    # public ops resolve backend="triton" against a (here absent) CUDA device
    _backend._triton_status = lambda: _backend.BackendStatus(True, f"AOT capture for {target.arch}")
    from ._opaque import direct_triton_launches

    try:
        with _MetaAsCuda(), direct_triton_launches():
            yield launches
    finally:
        JITFunction.run, gemm_common.num_sms, gemm_common.arch_major, _backend._triton_status = saved


def launches_of(cases: list[Case], target: Target) -> list[Launch]:
    out = []
    for case in cases:
        with capture_launches(target) as recorded:
            case.run()
        if not recorded:
            raise RuntimeError(f"aot case {case.name!r} launched no Triton kernel")
        out += [Launch(case, fn, args, kwargs) for fn, args, kwargs in recorded]
    return out


# ------------------------------------------------------------------------------ compiling


def _specialise(launch: Launch, target: Target):
    """-> (ASTSource, options) exactly as JITFunction.run would build them for this target."""
    from triton.compiler import ASTSource, make_backend
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    gpu = GPUTarget("cuda", target.capability, 32)
    backend = make_backend(gpu)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    args = [_StorageOffsetPointer(a) if isinstance(a, torch.Tensor) else a for a in launch.args]
    kwargs = {k: _StorageOffsetPointer(v) if isinstance(v, torch.Tensor) else v for k, v in launch.kwargs.items()}
    kwargs["debug"] = False
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return gpu, ASTSource(fn, signature, constexprs, attrs), options


def _config(launch: Launch, options) -> str:
    consts = [f"{k}={v}" for k, v in launch.kwargs.items()
              if isinstance(v, (int, bool, str)) and k[:1].isupper() and k not in ("PRECISION", "DOT_PREC")]
    return " ".join(consts + [f"w{options.num_warps}", f"s{options.num_stages}"])


def _structure(launch: Launch, options) -> tuple[str, bool]:
    """(tile "BMxBNxBK w8 s4" from the launch's block constexprs, whether the kernel is persistent:
    it takes its program count and strides over tiles)."""
    kw = dict(launch.kwargs)
    if isinstance(kw.get("BN"), int) and kw.get("HALVES", 1) > 1:  # BN is the width of one accumulator
        kw["BN"] *= kw["HALVES"]
    names = ("BM", "BN", "BK", "BT", "BC", "BLOCK_M", "BLOCK_N", "BLOCK_K")
    dims = [kw[k] for k in names if isinstance(kw.get(k), int)]
    tile = "x".join(str(d) for d in dims[:3])
    warps_stages = f"w{options.num_warps} s{options.num_stages}"
    tile = f"{tile} {warps_stages}" if tile else warps_stages
    return tile, "num_progs" in launch.fn.arg_names


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def read_cubin(cubin: bytes) -> dict:
    """Registers, stack and the SASS opcodes that matter, from the wheel's cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    opcodes = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M))
    return {
        "regs": int(regs.group(1)) if regs else None,
        "stack_bytes": int(stack.group(1)) if stack else None,
        "spill_ops": opcodes["LDL"] + opcodes["STL"],
        "mma": sorted(op for op in opcodes if "MMA" in op),
        "tma_loads": sum(n for op, n in opcodes.items() if op.startswith(("UTMALDG", "UBLKCP"))),
        "setmaxnreg": sum(n for op, n in opcodes.items() if op.startswith(("SETMAXNREG", "USETMAXREG"))),
    }


@contextlib.contextmanager
def _ptxas_log_printed():
    """Triton prints ptxas' ``-v`` log after each compile (``knobs.nvidia.dump_ptxas_log``)."""
    from triton import knobs

    before = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        yield
    finally:
        knobs.nvidia.dump_ptxas_log = before


def _serialized_in(ptxas_log: str) -> bool:
    return "C7514" in ptxas_log or "wgmma.mma_async instructions are serialized" in ptxas_log


def wgmma_serialized(ptx: str, arch: str) -> bool:
    """Whether ptxas serializes the kernel's warpgroup MMAs (a wait after every wgmma instead of
    one per batch), which it reports only as an info line (C7514: e.g. a non-wgmma instruction
    reading an in-flight accumulator, or too few registers for the wgmma pipeline)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([_tool("ptxas"), f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True)
    return _serialized_in(done.stderr)


def compile_launch(launch: Launch, target: Target) -> Report:
    import triton

    rep = Report(kernel=launch.fn.fn.__name__, case=launch.case.name, target=target.arch, config="",
                 expected_mma=launch.case.mma)
    t0 = time.perf_counter()
    try:
        gpu, src, options = _specialise(launch, target)
        rep.config = _config(launch, options)
        rep.tile, rep.persistent = _structure(launch, options)
        printed = io.StringIO()  # Triton prints the whole PTX when ptxas fails, and ptxas' log (below)
        with contextlib.redirect_stdout(printed), _ptxas_log_printed():
            k = triton.compile(src, target=gpu, options=options.__dict__)
        rep.shared_bytes = int(k.metadata.shared)
        if "tt.dot" not in k.asm["ttir"]:  # a helper kernel of a GEMM case (e.g. an operand re-layout)
            rep.expected_mma = None
        rep.tcgen05_ptx = "tcgen05.mma" in k.asm["ptx"]
        for key, value in read_cubin(k.asm["cubin"]).items():
            setattr(rep, key, value)
        if "wgmma" in k.asm["ptx"]:
            log = printed.getvalue()
            # the compile's own ptxas log; a kernel from Triton's cache ran no ptxas: assemble it again
            rep.wgmma_serialized = (_serialized_in(log) if "ptxas info" in log
                                    else wgmma_serialized(k.asm["ptx"], target.arch))
    except Exception as e:  # a kernel that does not compile is a finding, reported per kernel
        lines = str(e).strip().splitlines() or [""]
        fatal = [line for line in lines if "ptxas fatal" in line]
        rep.error = f"{type(e).__name__}: {(fatal or lines)[0][:300]}"
    rep.compile_s = time.perf_counter() - t0
    return rep


def _dedupe_key(launch: Launch, target: Target):
    try:
        _, src, options = _specialise(launch, target)
        return (launch.fn.fn.__qualname__, repr(src.signature), repr(sorted(src.constants.items(), key=str)),
                repr(sorted(src.attrs.items(), key=str)), repr(sorted(options.__dict__.items(), key=str)))
    except Exception:  # let compile_launch report it
        return (id(launch),)


_WORK: list[tuple[Launch, Target]] = []  # shared with forked workers by index


def _compile_index(i: int) -> Report:
    return compile_launch(*_WORK[i])


def compile_in_process(cases: list[Case], archs: list[str], jobs: int = 1, subset: str = "all") -> list[Report]:
    """Every distinct (kernel, specialisation, options) of the cases, compiled for each arch."""
    work, keys = [], {}
    for arch in archs:
        target = TARGETS[arch]
        mine = [c for c in cases if subset == "all" or in_ci_subset(c, arch)]
        for launch in launches_of(mine, target):
            key = (arch,) + _dedupe_key(launch, target)
            if key in keys:
                if launch.case.name not in keys[key][1] and launch.case.name != work[keys[key][0]][0].case.name:
                    keys[key][1].append(launch.case.name)
                continue
            keys[key] = [len(work), []]
            work.append((launch, target))
    _WORK[:] = work
    if jobs > 1 and len(work) > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            reports = pool.map(_compile_index, range(len(work)), chunksize=1)
    else:
        reports = [_compile_index(i) for i in range(len(work))]
    for index, extra in keys.values():
        reports[index].also_cases = extra
    return reports


def problems(rep: Report) -> list[str]:
    """What is wrong with a compiled kernel (empty: nothing)."""
    if rep.error:
        return [f"does not compile: {rep.error}"]
    out = []
    if rep.spill_ops or rep.stack_bytes:
        out.append(f"spills: {rep.spill_ops} local loads/stores, {rep.stack_bytes} B stack")
    if rep.wgmma_serialized:
        out.append("ptxas serialized the wgmma pipeline (C7514): a wait after every warpgroup MMA")
    if rep.shared_bytes is not None and rep.shared_bytes > SHARED_LIMIT_BYTES:
        out.append(f"shared memory {rep.shared_bytes} B > {SHARED_LIMIT_BYTES} B per block")
    if rep.expected_mma is not None:
        cap = TARGETS[rep.target].capability
        want = _MMA_SASS[(rep.expected_mma, cap)]
        if want not in rep.mma:
            out.append(f"no {want} in the SASS ({rep.expected_mma} tensor-core path lost; "
                       f"MMA seen: {rep.mma or 'none'})")
        legacy = [op for op in rep.mma if op in _LEGACY_MMA]
        if legacy:
            out.append(f"pre-Hopper mma.sync ({', '.join(legacy)}) beside the {want} path")
        if cap >= 100 and not rep.tcgen05_ptx:
            out.append("no tcgen05.mma in the PTX")
    return out


# ------------------------------------------------------------------------------ entry points


def load_cases(subset: str = "all", extra: str | None = None) -> list[Case]:
    """The package's cases (``subset="ci"``: those marked for the test suite) plus those of
    ``CASES`` in the Python file ``extra``, if given."""
    from .aot_cases import all_cases

    cases = [c for c in all_cases() if subset == "all" or c.ci]
    if extra:
        spec = importlib.util.spec_from_file_location("_aot_extra_cases", extra)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cases += [c for c in module.CASES if subset == "all" or c.ci]
    return cases


def compile_reports(archs=("sm_90a", "sm_100a"), subset: str = "all", extra: str | None = None,
                    jobs: int | None = None, timeout_s: float = 900) -> list[Report]:
    """Compile the cases for ``archs``; in a subprocess free of TRITON_INTERPRET when this
    process runs the interpreter."""
    from ._backend import triton_interpreter_enabled

    for arch in archs:
        if arch not in TARGETS:
            raise ValueError(f"aot: arch must be one of {sorted(TARGETS)}, got {arch!r}")
    if subset not in ("ci", "all"):
        raise ValueError(f"aot: subset must be 'ci' or 'all', got {subset!r}")
    jobs = jobs or max(1, min(4, os.cpu_count() or 1))
    if not triton_interpreter_enabled():
        return compile_in_process(load_cases(subset, extra), list(archs), jobs, subset)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "reports.json")
        cmd = [sys.executable, "-m", "primerl.kernels.aot", "--arch", ",".join(archs), "--subset", subset,
               "--jobs", str(jobs), "--json", out, "--quiet"] + (["--extra", extra] if extra else [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"aot subprocess failed ({done.returncode}):\n{done.stderr[-4000:]}")
        with open(out) as f:
            return [Report(**r) for r in json.load(f)]


def format_reports(reports: list[Report]) -> str:
    """One row per compiled kernel. Structure columns: ``tile`` (block shape, warps, stages),
    ``TMA`` (UTMALDG/UBLKCP count in the SASS), ``maxreg`` (SETMAXNREG/USETMAXREG count:
    warp-specialized register reallocation), ``pers`` (persistent grid), ``wgmma`` (``async``:
    warpgroup MMAs issued in batches; ``SERIAL``: ptxas waits after each one)."""
    cols = ["kernel", "target", "tile", "TMA", "maxreg", "pers", "wgmma", "regs", "spills", "shared", "MMA", "case",
            "config", "check"]
    rows = []
    for r in reports:
        bad = problems(r)
        mma = ",".join(op for op in r.mma) or "-"
        case = r.case + (f" (+{len(r.also_cases)} more)" if r.also_cases else "")
        num = lambda v: "-" if v is None else str(v)  # noqa: E731
        rows.append([r.kernel.lstrip("_"), r.target, r.tile or "-", num(r.tma_loads), num(r.setmaxnreg),
                     "-" if r.persistent is None else ("yes" if r.persistent else "no"),
                     "-" if r.wgmma_serialized is None else ("SERIAL" if r.wgmma_serialized else "async"),
                     num(r.regs), num(r.spill_ops),
                     "-" if r.shared_bytes is None else f"{r.shared_bytes / 1024:.1f} KB", mma, case, r.config,
                     "ok" if not bad else "FAIL: " + "; ".join(bad)])
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m primerl.kernels.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90a,sm_100a")
    parser.add_argument("--subset", default="all", choices=["ci", "all"])
    parser.add_argument("--extra", default=None, help="a Python file defining CASES (a list of aot.Case)")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the reports here")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    reports = compile_reports(args.arch.split(","), args.subset, args.extra, args.jobs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in reports], f)
    if not args.quiet:
        print(format_reports(reports))
        print(f"\n{len(reports)} compiles in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
