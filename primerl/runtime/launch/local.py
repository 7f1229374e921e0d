"""``deployment.kind = "nodes"``: a job on named hosts, one ``primerl node`` process per (node, role).

When every host is a 127.x address, ``primerl rl`` starts the nodes on this machine: each process
in its own working directory ``<output_dir>/nodes/node<i>``, logging to
``<output_dir>/logs/node<i>-<role>.log``, a row each in ``<output_dir>/processes.json``
(``processes.start_process``; the node processes do not
die with the launcher: each stops its own group on SIGTERM). ``wait`` prints progress from
``metrics.jsonl``; when a node's process fails it names the node, its host and role (with the end
of its log) and ``stop`` stops the others, each given ``deployment.grace_s`` to finish (a
checkpoint being written), then killed. On other hosts, ``start`` fails with the command to run on
each host (``--dry-run`` prints them too).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from ..config import ConfigError, RLConfig
from ..heartbeat import HEARTBEAT_DIR_ENV
from ..lifetime import LAUNCHER_PID_ENV, log_tail
from ..metrics import ascii_curve, progress_line, read_metrics
from ..processes import ProcessTable, start_process
from .common import JobFailed
from .deployment import Node, describe_nodes, is_loopback, node_plan
from .node_supervise import SUPERVISED_ENV
from .launcher import LauncherCapabilities, PreparedJob, check_spans_nodes, register_launcher
from .watchdog import StallWatchdog

__all__ = ["NodesLauncher", "is_local_nodes", "node_commands"]


def is_local_nodes(cfg: RLConfig) -> bool:
    """Every host of the plan is this machine (127.x or ``localhost``): ``primerl rl`` starts them."""
    return all(is_loopback(h) for h in cfg.deployment.hosts)


def node_commands(cfg: RLConfig, config_path: str, *,
                  python: str = sys.executable) -> list[tuple[Node, str, list[str]]]:
    """``(node, role, argv)`` of every process of the job, in start order (inference, trainer, orchestrator)."""
    plan = node_plan(cfg)
    out = []
    for role in ("inference", "trainer", "orchestrator"):
        for n in plan.with_role(role):
            out.append((n, role, [python, "-m", "primerl.runtime.cli", "node", "--config", config_path, "--role", role,
                                  "--node-rank", str(n.index)]))
    return out


def _need(cond: bool, key: str, msg: str, value) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}, got {value!r}")


class NodesLauncher:
    """The nodes of ``deployment.hosts``: started here when they are 127.x addresses."""

    name = "nodes"
    capabilities = LauncherCapabilities(spans_nodes=True, server_pool=False, restarts=True)

    def check(self, cfg: RLConfig) -> None:
        check_spans_nodes(cfg)
        d = cfg.deployment
        n = d.trainer_nodes + d.inference_nodes + (d.orchestrator == "own")
        _need(len(d.hosts) == n, "deployment.hosts",
              f"must list {n} hosts ({d.trainer_nodes} trainer + {d.inference_nodes} inference"
              f"{' + 1 orchestrator' if d.orchestrator == 'own' else ''}, in that order)", d.hosts)
        _need(len(set(d.hosts)) == len(d.hosts), "deployment.hosts", "must be distinct", d.hosts)

    def describe(self, cfg: RLConfig) -> str:
        cfg_path = str(Path(cfg.output_dir).resolve() / "config.toml")
        lines = [f"# on {node.host}: {' '.join(argv)}\n" for node, role, argv in node_commands(cfg, cfg_path,
                                                                                              python="python")]
        return describe_nodes(cfg) + "".join(lines)

    def start(self, job: PreparedJob) -> None:
        cfg, out = job.cfg, job.output_dir
        cfg_path = str(job.config_path)
        if not is_local_nodes(cfg):
            cmds = "\n".join(" ".join(argv) for _, _, argv in node_commands(cfg, cfg_path))
            raise JobFailed("deployment.hosts are not all 127.x addresses, so this machine cannot start them; run "
                            f"on each host (the config at {cfg_path} copied there):\n{cmds}")
        beats = out / "heartbeats"
        shutil.rmtree(beats, ignore_errors=True)  # a previous start's processes
        # this launcher restarts the agents itself (launcher.run_job): they run one round each
        env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads), PYTHONUNBUFFERED="1",
                   **{LAUNCHER_PID_ENV: str(os.getpid()), HEARTBEAT_DIR_ENV: str(beats), SUPERVISED_ENV: "launcher"})
        plan = node_plan(cfg)

        def log_for(name: str) -> Path:  # trainer-rank<R> -> the log of R's node; orchestrator / inference -> theirs
            role, _, rank = name.partition("-rank")
            node = next((n for n in plan.nodes if rank and int(rank) in n.ranks), None) or plan.with_role(role)[0]
            return out / "logs" / f"node{node.index}-{role}.log"

        job.state["watchdog"] = StallWatchdog(beats, cfg.deployment.stall_timeout_s, log_for,
                                              startup_s=cfg.deployment.stall_startup_s)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[3]), env.get("PYTHONPATH"))
                                            if p)
        procs = job.state["procs"] = {}
        job.state["t0"] = time.perf_counter()
        if not job.quiet:
            print(f"primerl rl: {len(node_plan(cfg).nodes)} local nodes | output_dir {out} | start step "
                  f"{job.start_step} | logs in {out / 'logs'}", flush=True)
        table = ProcessTable(out / "processes.json")  # a row per node process (the inference node's: its URL)
        for node, role, argv in node_commands(cfg, cfg_path):
            name = f"node{node.index}-{role}"
            wd = out / "nodes" / f"node{node.index}"
            wd.mkdir(parents=True, exist_ok=True)
            url = f"http://{node.host}:{cfg.inference.vllm.port}" if role == "inference" else None
            procs[name] = (node, role, start_process(argv, name=name, role=role, log_path=out / "logs" / f"{name}.log",
                                                     env=env, cwd=wd, die_with_parent=False, table=table, url=url))
        (out / "pids").write_text("".join(f"{name} {p.pid}\n" for name, (_, _, p) in procs.items()))

    def wait(self, job: PreparedJob, *, poll_s: float = 0.2) -> list[dict]:
        cfg, out, procs = job.cfg, job.output_dir, job.state["procs"]
        seen, first_seen = job.start_step - 1, {}
        trainers = [p for _, role, p in procs.values() if role == "trainer"]
        while True:
            for r in read_metrics(out / "metrics.jsonl"):
                if r["step"] > seen:
                    seen = r["step"]
                    if not job.quiet and cfg.log.progress:
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
                                           "ProducerDied" in log_tail(out / "logs" / f"{f[0]}.log")))
                name, n, role, p = failed[0]
                raise JobFailed(f"node {n.index} ({n.host}) {role} exited with code {p.returncode}; end of "
                                f"{out / 'logs' / (name + '.log')}:\n{log_tail(out / 'logs' / (name + '.log'))}")
            if all(p.returncode == 0 for p in trainers):
                break
            stall = job.state["watchdog"].check()
            if stall:
                raise JobFailed(stall)
            time.sleep(poll_s)
        rows = read_metrics(out / "metrics.jsonl")
        if not rows or rows[-1]["step"] != cfg.max_steps - 1:
            raise JobFailed(f"the trainer nodes exited normally but {out / 'metrics.jsonl'} ends at step "
                            f"{rows[-1]['step'] if rows else None}, not {cfg.max_steps - 1}")
        if not job.quiet:
            print(f"done: {len(rows)} steps in {time.perf_counter() - job.state['t0']:.1f} s; reward curve:\n"
                  f"{ascii_curve(rows)}", flush=True)
        return rows

    def stop(self, job: PreparedJob) -> None:
        for _, _, p in job.state.get("procs", {}).values():
            p.stop(job.cfg.deployment.grace_s)
        if "watchdog" in job.state:  # torchrun's workers (own sessions), a stopped one too
            job.state["watchdog"].end_leftovers()


register_launcher("nodes", NodesLauncher())
