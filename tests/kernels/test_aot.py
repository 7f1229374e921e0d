"""Every Triton kernel compiled ahead of time for sm_90a and sm_100a at the launch configuration
the package picks on those GPUs (primerl.kernels.aot): it compiles, does not spill, fits the
card's shared memory, and FP8 / bf16 dots keep their Hopper / Blackwell tensor-core path.

One subprocess (free of TRITON_INTERPRET) compiles the suite's subset of cases
(aot_cases ``ci=True``: every kernel, every distinct GEMM mode and tile shape) plus the
deliberately bad kernels of aot_bad_kernels.py, which prove the checker fails them. The full set
is ``python -m bench aot``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from primerl.kernels import aot
from primerl.kernels.aot_cases import all_cases

BAD_KERNELS = str(Path(__file__).with_name("aot_bad_kernels.py"))
CI_CASES = [c for c in all_cases() if c.ci]

# Known failures, as (case name prefix, arch) -> reason; strict xfails, so a fix turns them into
# failures that ask for the entry to be removed. Empty: the first run's spills of the FP8 M-grouped
# kernel (table mode at BN=128, m_indices mode) are fixed in primerl/kernels/gemm/triton.py.
KNOWN: dict[tuple[str, str], str] = {}


def _has_nvidia_backend() -> bool:
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError:
        return False
    return Path(aot._tool("cuobjdump")).exists() and Path(aot._tool("ptxas")).exists()


# One xdist worker runs the whole file (--dist loadgroup): the module fixture ``reports`` is built
# once per worker that runs one of its tests, and the last CI compiled the suite on both workers.
pytestmark = [pytest.mark.skipif(not _has_nvidia_backend(),
                                 reason="triton wheel without the NVIDIA backend / ptxas / cuobjdump"),
              pytest.mark.xdist_group("aot_reports")]


@pytest.fixture(scope="module")
def reports():
    return aot.compile_reports(aot.CI_ARCHS, subset="ci", extra=BAD_KERNELS)


def _reports_of(reports, case_name, arch):
    return [r for r in reports if r.target == arch and case_name in [r.case] + r.also_cases]


def _params():
    out = []
    for case in CI_CASES:
        for arch in aot.CI_ARCHS:
            if not aot.in_ci_subset(case, arch):
                continue
            known = next((why for (prefix, a), why in KNOWN.items()
                          if a == arch and case.name.startswith(prefix)), None)
            marks = [pytest.mark.xfail(reason=known, strict=True)] if known else []
            out.append(pytest.param(case.name, arch, marks=marks, id=f"{arch}-{case.name}"))
    return out


@pytest.mark.parametrize("case_name, arch", _params())
def test_kernel_compiles_clean(reports, case_name, arch):
    mine = _reports_of(reports, case_name, arch)
    assert mine, f"no compiled kernel for {case_name} on {arch}"
    bad = {f"{r.kernel} [{r.config}]": aot.problems(r) for r in mine if aot.problems(r)}
    assert not bad, f"{case_name} on {arch}: {bad}"


def _only(reports, case_name, arch):
    mine = _reports_of(reports, case_name, arch)
    assert len(mine) == 1, [r.case for r in mine]
    return mine[0]


@pytest.mark.parametrize("arch", aot.CI_ARCHS)
def test_checker_flags_a_lost_tensor_core_path(reports, arch):
    """A 16 x 16 FP8 tile is too small for wgmma / tcgen05: mma.sync (HMMA) at best."""
    rep = _only(reports, "bad: fp8 dot 16x16x32 one warp", arch)
    want = "QGMMA" if arch == "sm_90a" else "UTCQMMA"
    assert any(f"no {want}" in p for p in aot.problems(rep)), aot.problems(rep)
    good = _only(reports, "good: fp8 dot 128x128x64 8 warps", arch)
    assert aot.problems(good) == [] and want in good.mma, (good, aot.problems(good))


def test_checker_flags_spills(reports):
    rep = _only(reports, "bad: prefix sum of 8192 floats in one warp", "sm_90a")
    assert rep.spill_ops > 0 and any(p.startswith("spills") for p in aot.problems(rep)), rep


@pytest.mark.parametrize("arch", aot.CI_ARCHS)
def test_checker_flags_shared_memory_over_the_limit(reports, arch):
    rep = _only(reports, "bad: bf16 dot 256x256x128 4 stages", arch)
    assert rep.shared_bytes > aot.SHARED_LIMIT_BYTES
    assert any(p.startswith("shared memory") for p in aot.problems(rep)), aot.problems(rep)


def test_checker_flags_serialized_wgmma(reports):
    """A dot result read while the next dot is in flight: ptxas waits after every wgmma."""
    rep = _only(reports, "bad: fp8 dot result used one iteration late", "sm_90a")
    assert rep.wgmma_serialized and any("serialized" in p for p in aot.problems(rep)), (rep, aot.problems(rep))
    good = _only(reports, "good: fp8 dot 128x128x64 8 warps", "sm_90a")
    assert good.wgmma_serialized is False


def test_launch_configuration_is_the_gpu_one(reports):
    """The captured launch uses the GPU tile table at the target's SM count, not the interpreter's."""
    from primerl.kernels.gemm.triton import pick_tiles

    for m, n, k in [(128, 2112, 7168), (4096, 7168, 2048)]:
        rep = _only(reports, f"fp8 gemm nt M={m} N={n} K={k}", "sm_90a")
        cfg = pick_tiles(m, n, k, True, 1, interpreter=False, num_sms=aot.TARGETS["sm_90a"].num_sms)
        want = {f"BM={cfg['BM']}", f"BN={cfg['BN']}", f"BK={cfg['BK']}",
                f"w{cfg['num_warps']}", f"s{cfg['num_stages']}"}
        assert want <= set(rep.config.split()), (rep.config, want)


def test_structure_columns(reports):
    """The FP8 GEMMs show their Hopper structure in the table: TMA loads in the SASS, a persistent
    grid, the tile (on Hopper 128 x 256: two accumulators sharing each A box, see
    triton_fp8.fp8_structure), wgmma issued in batches; a kernel without descriptors shows no TMA."""
    for arch in aot.CI_ARCHS:
        rep = _only(reports, "fp8 gemm nt M=4096 N=7168 K=2048", arch)
        wide = arch == "sm_90a"
        assert rep.tma_loads > 0 and rep.persistent and rep.tile == f"128x{256 if wide else 128}x128 w8 s4", rep
        assert f"HALVES={2 if wide else 1}" in rep.config.split() and rep.wgmma_serialized is not True, rep
        assert rep.setmaxnreg == 0  # warp specialization is off (see primerl.kernels.gemm.triton_fp8)
        k_grouped = [r for r in _reports_of(reports, "fp8 k-grouped tn G=4 T=8192 N=4096 K=7168", arch)
                     if r.expected_mma]
        assert len(k_grouped) == 1 and k_grouped[0].tma_loads > 0 and k_grouped[0].persistent, k_grouped
    quant = _reports_of(reports, "fp8 per-token-group 4096x7168 g128", "sm_90a")
    assert quant and all(r.tma_loads == 0 and r.persistent is False for r in quant), quant
    header = aot.format_reports([rep]).splitlines()[0].split(" | ")
    assert [h.strip() for h in header[2:7]] == ["tile", "TMA", "maxreg", "pers", "wgmma"], header


def test_problems_of_a_clean_and_a_broken_report():
    clean = aot.Report(kernel="k", case="c", target="sm_100a", config="", expected_mma="bf16", regs=128, spill_ops=0,
                       stack_bytes=0, shared_bytes=100 * 1024, mma=["UTCHMMA"], tcgen05_ptx=True)
    assert aot.problems(clean) == []
    broken = aot.Report(kernel="k", case="c", target="sm_100a", config="", expected_mma="bf16", regs=255, spill_ops=3,
                        stack_bytes=16, shared_bytes=240 * 1024, mma=["HMMA"], tcgen05_ptx=False)
    got = aot.problems(broken)
    assert len(got) == 5 and got[0].startswith("spills") and got[1].startswith("shared memory"), got
    assert aot.problems(aot.Report(kernel="k", case="c", target="sm_90a", config="", expected_mma=None,
                                   error="PTXASError: x")) == ["does not compile: PTXASError: x"]


_SPILLING_CU = r"""
// 64 float accumulators live across a loop with at most 32 registers a thread (1024 threads x 2 blocks)
__global__ void __launch_bounds__(1024, 2) many_live(const float* x, float* y, int n) {
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = x[i * n + threadIdx.x];
  for (int k = 0; k < n; ++k) {
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = acc[i] * x[k] + acc[(i + 1) % 64];
  }
#pragma unroll
  for (int i = 0; i < 64; ++i) y[i * n + threadIdx.x] = acc[i];
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on the PATH")
def test_check_cuda_fails_a_spilling_kernel(tmp_path):
    """.ci/check_cuda.sh (what CI runs on csrc/) reads ptxas -v and fails a kernel that spills."""
    src = tmp_path / "spill.cu"
    src.write_text(_SPILLING_CU)
    script = Path(__file__).resolve().parents[2] / ".ci" / "check_cuda.sh"
    # the script runs `python` for torch's include paths: this interpreter's, as in CI's activated venv
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    done = subprocess.run(["bash", str(script), str(src)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert all(s in done.stdout for s in ("spills registers", "many_live", "bytes spill stores")), done.stdout
