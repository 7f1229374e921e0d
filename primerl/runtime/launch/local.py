"""A ``deployment.kind = "nodes"`` job whose hosts are all 127.x addresses, started by ``primerl rl``
on this machine: one ``primerl node`` process per (node, role), each in its own working directory
``<output_dir>/nodes/node<i>`` and logging to ``<output_dir>/logs/node<i>-<role>.log``.

The launcher prints progress from ``metrics.jsonl``; when a node's process fails it names the
node, its host and role (with the end of its log) and stops the others, each given
``deployment.grace_s`` to finish (a checkpoint being written), then killed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ..config import RLConfig
from .common import JobFailed, prepare_output
from .deployment import Node, is_loopback, node_plan

__all__ = ["node_commands", "run_nodes", "is_local_nodes"]


def is_local_nodes(cfg: RLConfig) -> bool:
    d = cfg.deployment
    return d.kind == "nodes" and all(is_loopback(h) for h in d.hosts)


def node_commands(cfg: RLConfig, config_path: str, *, python: str = sys.executable) -> list[tuple[Node, str, list[str]]]:
    """``(node, role, argv)`` of every process of the job, in start order (inference, trainer, orchestrator)."""
    plan = node_plan(cfg)
    out = []
    for role in ("inference", "trainer", "orchestrator"):
        for n in plan.with_role(role):
            out.append((n, role, [python, "-m", "primerl.runtime.cli", "node", "--config", config_path, "--role", role,
                                  "--node-rank", str(n.index)]))
    return out


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def run_nodes(cfg: RLConfig, *, quiet: bool = False, poll_s: float = 0.2) -> list[dict]:
    """Run every node of the plan as local processes until the trainer nodes finish."""
    from ..lifetime import LAUNCHER_PID_ENV, stop_process_group
    from ..metrics import ascii_curve, progress_line, read_metrics

    out = Path(cfg.output_dir).resolve()
    start = prepare_output(cfg)  # writes the resolved config.toml that the nodes read
    if not is_local_nodes(cfg):
        cmds = "\n".join(" ".join(argv) for _, _, argv in node_commands(cfg, str(out / "config.toml")))
        raise JobFailed("deployment.hosts are not all 127.x addresses, so this machine cannot start them; run "
                            f"on each host (the config at {out / 'config.toml'} copied there):\n{cmds}")
    cfg_path = str(out / "config.toml")
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads), PYTHONUNBUFFERED="1", **{LAUNCHER_PID_ENV: str(os.getpid())})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[3]), env.get("PYTHONPATH")) if p)
    procs: dict[str, tuple[Node, str, subprocess.Popen]] = {}
    t0 = time.perf_counter()
    if not quiet:
        print(f"primerl rl: {len(node_plan(cfg).nodes)} local nodes | output_dir {out} | start step {start} | "
              f"logs in {out / 'logs'}", flush=True)
    try:
        for node, role, argv in node_commands(cfg, cfg_path):
            name = f"node{node.index}-{role}"
            wd = out / "nodes" / f"node{node.index}"
            wd.mkdir(parents=True, exist_ok=True)
            with open(out / "logs" / f"{name}.log", "ab") as f:
                p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=wd, start_new_session=True)
            procs[name] = (node, role, p)
        (out / "pids").write_text("".join(f"{name} {p.pid}\n" for name, (_, _, p) in procs.items()))
        seen, first_seen = start - 1, {}
        trainers = [p for _, role, p in procs.values() if role == "trainer"]
        while True:
            for r in read_metrics(out / "metrics.jsonl"):
                if r["step"] > seen:
                    seen = r["step"]
                    if not quiet and cfg.log.progress:
                        print(progress_line(r, cfg.max_steps), flush=True)
            for name, (_, _, p) in procs.items():
                if p.poll() not in (None, 0):
                    first_seen.setdefault(name, time.monotonic())
            if first_seen:
                # wait a moment for the peers it takes down, then name the cause: the first to fail;
                # among those seen together one killed by a signal, a trainer, one whose log has no ProducerDied
                time.sleep(1.0)
                for name, (_, _, p) in procs.items():
                    if p.poll() not in (None, 0):
                        first_seen.setdefault(name, time.monotonic())
                t_first = min(first_seen.values())
                failed = [(name, *procs[name]) for name, t in first_seen.items() if t - t_first < 0.5]
                failed.sort(key=lambda f: (f[3].returncode > 0, f[2] != "trainer",
                                           "ProducerDied" in _tail(out / "logs" / f"{f[0]}.log")))
                name, n, role, p = failed[0]
                raise JobFailed(f"node {n.index} ({n.host}) {role} exited with code {p.returncode}; end of "
                                    f"{out / 'logs' / (name + '.log')}:\n{_tail(out / 'logs' / (name + '.log'))}")
            if all(p.returncode == 0 for p in trainers):
                break
            time.sleep(poll_s)
    finally:
        for _, _, p in procs.values():
            stop_process_group(p, cfg.deployment.grace_s)
    rows = read_metrics(out / "metrics.jsonl")
    if not rows or rows[-1]["step"] != cfg.max_steps - 1:
        raise JobFailed(f"the trainer nodes exited normally but {out / 'metrics.jsonl'} ends at step "
                            f"{rows[-1]['step'] if rows else None}, not {cfg.max_steps - 1}")
    if not quiet:
        print(f"done: {len(rows)} steps in {time.perf_counter() - t0:.1f} s; reward curve:\n{ascii_curve(rows)}",
              flush=True)
    return rows
