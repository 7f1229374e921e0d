"""``primerl rl`` with ``inference.vllm.launch = true`` against a real vLLM server: the job starts
the server itself (the example config), samples with it on policy, updates it after every step,
learns, and its end leaves no process of the server behind. Skipped when vLLM is not installed."""

import os
from pathlib import Path

import pytest

from primerl.runtime.validate import load_config
from primerl.runtime.launch.machine import run_rl

from vllm_testing import REPO, free_port, need_vllm

pytestmark = pytest.mark.vllm

STEPS = 12


def _processes_mentioning(fragment: str) -> list[str]:
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if fragment in cmd and state != "Z":
            found.append(f"{d.name}: {cmd[:200]}")
    return found


def test_job_launches_vllm_learns_and_leaves_nothing_behind(tmp_path):
    py = need_vllm()
    out = tmp_path / "run"
    port = free_port()
    cfg = load_config(REPO / "examples" / "reverse_text_vllm.toml",
                      ["--output_dir", str(out), "--max_steps", str(STEPS), "--orchestrator.max_async_level", "0",
                       "--inference.vllm.python", py, "--inference.vllm.port", str(port),
                       "--inference.vllm.url", f"http://127.0.0.1:{port}", "--log.plot", "false",
                       "--inference.vllm.launch_timeout_s", "600"])
    rows = run_rl(cfg, quiet=True)
    assert [r["step"] for r in rows] == list(range(STEPS))
    # on policy (max_async_level 0): the trainer's log-probs of the sampled tokens are the server's
    assert all(r["policy_version"] == r["step"] and r["off_policy/max"] == 0 for r in rows)
    assert max(r["mismatch_kl/mean"] for r in rows) < 1e-3
    first = sum(r["reward/mean"] for r in rows[:3]) / 3
    last = sum(r["reward/mean"] for r in rows[-3:]) / 3
    assert last > first + 0.02, [round(r["reward/mean"], 3) for r in rows]
    log = (out / "logs" / "vllm.log").read_text(errors="replace")
    assert "vllm_init" in log and (out / "vllm_init" / "config.json").exists()
    assert log.count("POST /collective_rpc") >= STEPS  # one verified update per policy version
    assert _processes_mentioning(str(out / "vllm_init")) == []
