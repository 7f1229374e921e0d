"""The README's test command (``-n N --dist loadgroup``) keeps every test of one xdist group on one worker:
pytest 9 ignores the ``item._nodeid`` that pytest-xdist 3.8 rewrites for it, so tests/conftest.py puts
the group suffix on the node id itself. Without it, the groups (one vLLM server at a time, fixed ports,
module fixtures shared by a group) were spread over the workers like ``--dist load``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_TESTS = '''
import os, pytest

def _record(name):
    with open(os.environ["GROUP_LOG"], "a") as f:
        f.write(f"{name} {os.environ.get('PYTEST_XDIST_WORKER', 'none')}\\n")

@pytest.mark.parametrize("i", range(6))
@pytest.mark.xdist_group("one")
def test_grouped(i):
    _record("grouped")

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    import time; time.sleep(0.2)
    _record("free")

@pytest.mark.parametrize("i", range(3))
@pytest.mark.vllm
def test_marked(i):
    _record("marked")

@pytest.mark.verifiers
def test_in_the_verifiers_venv():
    _record("verifiers")
'''

# the order in which the controller hands the work units out (xdist's queue order), scope by scope
_PLUGIN = '''
import os
from xdist.scheduler import LoadGroupScheduling

class Recording(LoadGroupScheduling):
    def _assign_work_unit(self, node):
        with open(os.environ["GROUP_LOG"] + ".queue", "a") as f:
            f.write(next(iter(self.workqueue)) + "\\n")
        super()._assign_work_unit(node)

def pytest_xdist_make_scheduler(config, log):
    return Recording(config, log)
'''


def test_a_group_runs_on_one_worker(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(f"exec(open({str(ROOT / 'tests' / 'conftest.py')!r}).read())\n")
    (tmp_path / "tests" / "test_groups_demo.py").write_text(_TESTS)
    (tmp_path / "queue_recorder.py").write_text(_PLUGIN)
    log = tmp_path / "log.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("PRIMERL_VLLM_READY", "PRIMERL_VF_READY")}  # no wait
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "queue_recorder",
                        "-n", "2", "--dist", "loadgroup", "-c", str(ROOT / "pyproject.toml"),
                        "--rootdir", str(tmp_path), "tests"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=dict(env, GROUP_LOG=str(log),
                                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(tmp_path)])))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line.split() for line in log.read_text().splitlines()]
    workers = {name: {w for n, w in rows if n == name} for name in ("grouped", "free", "marked")}
    assert len([n for n, _ in rows]) == 16
    # the queue (tests/venv_ready.py: order_units; the conftest turns xdist's reorder by size off): the group,
    # half of the single tests, the units that need a venv (the vllm group first), the other half
    queue = [s.split("::")[-1] for s in (tmp_path / "log.txt.queue").read_text().split()]
    assert queue == ["one", "test_free[0]", "test_free[1]", "test_free[2]", "vllm", "test_in_the_verifiers_venv",
                     "test_free[3]", "test_free[4]", "test_free[5]"], queue
    assert len(workers["grouped"]) == 1, workers  # the xdist_group mark
    assert len(workers["marked"]) == 1, workers  # the conftest's group for a marker (vllm)
    assert workers["grouped"] <= {"gw0", "gw1"}, workers
