"""A third inference backend and a third launcher, from outside the ``primerl`` package.

Both go through the runtime's public doors (docs/extending.md):

- ``CountingBackend`` (``inference.backend``): the embedded engine, with a client that counts the
  completions it hands to the orchestrator and reports them as the metric ``ext/completions``
  (cumulative), so every row of ``metrics.jsonl`` shows that this backend served the step.
- ``TwoProcessLauncher`` (``deployment.kind``): the orchestrator and the trainer as two processes
  of this machine, started with ``primerl.runtime.processes.start_process`` (logs
  ``logs/ext-<role>.log``, rows in ``processes.json``), after the runtime's one shared preparation.

Use it by name (the module importable, e.g. ``PYTHONPATH=examples/extending``)::

    primerl rl --config examples/reverse_text.toml \\
        --inference.backend primerl_ext_demo:CountingBackend \\
        --deployment.kind primerl_ext_demo:TwoProcessLauncher

or through the entry-point groups ``primerl.inference_backends`` / ``primerl.launchers`` of an
installed package (then ``--inference.backend counting --deployment.kind two-process``).
"""

from __future__ import annotations

import os
import sys
import time

from primerl.runtime.config import ConfigError
from primerl.runtime.inference.backend import register_backend
from primerl.runtime.inference.embedded_backend import EmbeddedBackend
from primerl.runtime.launch.common import JobFailed
from primerl.runtime.launch.launcher import LauncherCapabilities, PreparedJob, register_launcher
from primerl.runtime.lifetime import LAUNCHER_PID_ENV, log_tail
from primerl.runtime.metrics import read_metrics
from primerl.runtime.processes import ProcessTable, start_process


class CountingClient:
    """The embedded engine's client, counting the completions it returns (``metrics()``)."""

    def __init__(self, inner):
        self.inner, self.completions = inner, 0

    def submit(self, req) -> None:
        self.inner.submit(req)

    def poll(self) -> list:
        out = self.inner.poll()
        self.completions += len(out)
        return out

    def abort(self, request_ids) -> None:
        self.inner.abort(request_ids)

    def has_pending(self) -> bool:
        return self.inner.has_pending()

    def servers_healthy(self) -> int:
        return self.inner.servers_healthy()

    def update_weights(self, version: int, transport) -> None:
        self.inner.update_weights(version, transport)

    def metrics(self) -> dict:
        return {**self.inner.metrics(), "ext/completions": self.completions}


@register_backend("counting")
class CountingBackend(EmbeddedBackend):
    """The embedded engine behind a counting client; everything else is the embedded backend's."""

    name = "counting"

    def check(self, cfg) -> None:
        super().check(cfg)
        if cfg.inference.num_servers > 1 or cfg.inference.pd.enabled:
            raise ConfigError("inference.num_servers: the counting backend wraps the in-process engine only "
                              f"(no server pool or P/D), got {cfg.inference.num_servers!r}")

    def describe(self, cfg) -> str:
        return "# inference servers: none (the counting backend: the embedded engine in the orchestrator)\n"

    def make_client(self, cfg, vocab_size, *, pool=None):
        return CountingClient(super().make_client(cfg, vocab_size, pool=pool))

    def weight_receiver(self, cfg, client, transport):
        return super().weight_receiver(cfg, client.inner, transport)

    def generate_server(self, cfg, client, *, policy_version, model_name):
        return super().generate_server(cfg, client.inner, policy_version=policy_version, model_name=model_name)


class TwoProcessLauncher:
    """The orchestrator and one trainer process on this machine; fails naming the process that failed."""

    name = "two-process"
    capabilities = LauncherCapabilities(spans_nodes=False, server_pool=False)

    def check(self, cfg) -> None:
        d = cfg.deployment
        if d.trainer_nodes != 1 or d.inference_nodes or d.orchestrator != "trainer" or d.hosts:
            raise ConfigError("deployment.kind: 'two-process' runs on this machine only, got "
                              f"{dict(trainer_nodes=d.trainer_nodes, inference_nodes=d.inference_nodes)!r}")
        if cfg.num_trainer_ranks != 1:
            raise ConfigError(f"num_trainer_ranks: 'two-process' runs one trainer rank, got {cfg.num_trainer_ranks!r}")

    def describe(self, cfg) -> str:
        return "# deployment: two-process (primerl_ext_demo): orchestrator + trainer on this machine\n"

    def start(self, job: PreparedJob) -> None:
        out, table = job.output_dir, ProcessTable(job.output_dir / "processes.json")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(job.cfg.threads),
                   **{LAUNCHER_PID_ENV: str(os.getpid())})
        procs = job.state["procs"] = {}
        for role in ("orchestrator", "trainer"):
            argv = [sys.executable, "-m", "primerl.runtime.cli", role, "--config", str(job.config_path)]
            procs[role] = start_process(argv, name=role, role=role, log_path=out / "logs" / f"ext-{role}.log",
                                        env=env, table=table)

    def wait(self, job: PreparedJob) -> list[dict]:
        procs = job.state["procs"]
        while procs["trainer"].poll() != 0:
            for role, p in procs.items():
                if p.poll() not in (None, 0):
                    log = job.output_dir / "logs" / f"ext-{role}.log"
                    raise JobFailed(f"the {role} exited with code {p.returncode}; end of {log}:\n{log_tail(log)}")
            time.sleep(0.2)
        return read_metrics(job.output_dir / "metrics.jsonl")

    def stop(self, job: PreparedJob) -> None:
        for p in job.state.get("procs", {}).values():
            p.stop(job.cfg.deployment.grace_s)


register_launcher("two-process", TwoProcessLauncher())
