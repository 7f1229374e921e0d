"""``primerl rl --dry-run`` names every process the job starts: a pool's servers (each with its
device) and router, P/D's prefill / decode servers and router with their hosts and ports, a launched
vLLM server; never "embedded engine" where the engines are the servers'."""

from __future__ import annotations

from pathlib import Path

import pytest

from primerl.runtime.cli import main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.fixed_ports  # the examples' P/D ports 8100, 8101, 8090, 8091: the dry run checks they are free


def _dry_run(capsys, tmp_path, example, *over) -> list[str]:
    capsys.readouterr()
    rc = main(["rl", "--config", str(ROOT / "examples" / example), "--output_dir", str(tmp_path / "o"), "--dry-run",
               *over])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    return [li for li in cap.out.splitlines() if li.startswith("# ")]


def _line(lines, head) -> str:
    return next(li for li in lines if li.startswith(head))


def test_a_pool_dry_run_names_its_servers_and_router(capsys, tmp_path):
    lines = _dry_run(capsys, tmp_path, "reverse_text.toml", "--inference.num_servers", "3")
    inf = _line(lines, "# inference: ")
    assert "3 `primerl inference` server processes" in inf and "embedded engine on" not in inf, inf
    assert all(f"inference-{k} on cpu" in inf for k in range(3)), inf
    node = _line(lines, "# node 0 ")
    assert "orchestrator + 3 inference servers inference-0..2 and a vllm-router" in node, node
    assert "processes.json" in node and "embedded engine" not in node, node


def test_a_pd_dry_run_names_prefill_decode_and_router_with_ports(capsys, tmp_path):
    lines = _dry_run(capsys, tmp_path, "reverse_text_pd.toml")
    inf = _line(lines, "# inference: ")
    assert "prefill-0 on cpu" in inf and "decode-0 on cpu" in inf and "embedded engine on" not in inf, inf
    node = _line(lines, "# node 0 ")
    assert "prefill server 127.0.0.1:8100, decode server 127.0.0.1:8101, vllm-router 127.0.0.1:8090" in node, node


def test_a_single_engine_dry_run_says_the_engine_is_in_the_orchestrator(capsys, tmp_path):
    lines = _dry_run(capsys, tmp_path, "reverse_text.toml")
    assert "embedded engine on the CPU" in _line(lines, "# inference: ")
    assert _line(lines, "# node 0 ").endswith("orchestrator + embedded engine")
