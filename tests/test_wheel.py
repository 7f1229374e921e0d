"""The built wheel and sdist hold what an installed primerl needs: every non-Python file under
primerl/ (the SLURM template, py.typed), the CUDA sources in the sdist; and the wheel, unpacked
outside the checkout, renders the sbatch script through ``primerl rl --dry-run``. (CI's
``.ci/run`` also pip-installs the wheel into a clean venv and runs its smoke test there.)"""

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "build", "dist", "*.egg-info", "outputs", "runs",
                              ".pytest_cache", "*.so", ".whl")


def _data_files() -> set[str]:
    """The non-Python files of the source package, as paths in the wheel."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "primerl").rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc", ".so") and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """(wheel, sdist) built by setuptools' PEP 517 backend from a copy of the tree (the checkout stays clean)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=SKIP)
    built = []
    for hook in ("build_wheel", "build_sdist"):
        code = f"import sys; from setuptools import build_meta as b; print('BUILT', b.{hook}(sys.argv[1]))"
        r = subprocess.run([sys.executable, "-c", code, str(dist)], cwd=src, capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, PRIMERL_BUILD_CUDA="0"))
        assert r.returncode == 0, r.stderr[-3000:]
        built.append(r.stdout.split("BUILT ")[-1].strip())
    wheel, sdist = built
    return {"wheel": dist / wheel, "sdist": dist / sdist, "tmp": tmp}


def test_the_wheel_holds_every_non_python_file_of_the_package(built):
    names = set(zipfile.ZipFile(built["wheel"]).namelist())
    want = _data_files()
    assert "primerl/runtime/launch/templates/sbatch.sh.j2" in want
    assert want <= names, f"missing from the wheel: {sorted(want - names)}"


def test_the_sdist_holds_the_cuda_sources_and_the_template(built):
    with tarfile.open(built["sdist"]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    want = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*") if p.is_file()}
    assert want and want <= names, f"missing from the sdist: {sorted(want - names)}"
    assert {"setup.py", "pyproject.toml", "primerl/runtime/launch/templates/sbatch.sh.j2"} <= names


def test_the_unpacked_wheel_renders_the_sbatch_script_outside_the_checkout(built):
    site, work = built["tmp"] / "site", built["tmp"] / "elsewhere"
    zipfile.ZipFile(built["wheel"]).extractall(site)
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "primerl.runtime.cli", "rl", "--config",
                        str(ROOT / "examples" / "reverse_text_2node.toml"), "--deployment.kind", "slurm",
                        "--deployment.hosts", "[]",
                        "--output_dir", str(work / "job"), "--dry-run"],
                       cwd=work, capture_output=True, text=True, timeout=300, env=dict(env, PYTHONPATH=str(site)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "# sbatch script" in r.stdout and "#SBATCH --nodes=2" in r.stdout, r.stdout[-3000:]
    where = subprocess.run([sys.executable, "-c", "import primerl; print(primerl.__file__)"], cwd=work,
                           capture_output=True, text=True, timeout=120, env=dict(env, PYTHONPATH=str(site)))
    assert where.stdout.strip() == str(site / "primerl" / "__init__.py")  # the wheel's, not the checkout's
