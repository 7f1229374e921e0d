"""Starting a P/D deployment for a job (``inference.pd``): prefill servers, decode servers and
vllm-router in P/D mode in front of them; and the vLLM commands of the same deployment.

Embedded engine (``inference.backend = "embedded"``): ``primerl inference --role prefill|decode``
processes on ``pd.host``, ports ``pd.base_port`` upward (prefill first), each serving the job's
resolved config (written to ``<output_dir>/pd/config.toml``); vLLM (``backend = "vllm"``): the
same deployment as vLLM servers with ``--kv-transfer-config`` (NixlConnector, ``kv_role =
kv_both``, its own side-channel port each). The router:
``vllm-router --vllm-pd-disaggregation --prefill URL ... --decode URL ... --port pd.router_port``.
Every process runs in its own process group tied to this one's life (``die_with_parent``), logs to
``<output_dir>/logs/<role>-<i>.log`` (``router.log``) like the pool's, and is listed in
``<output_dir>/processes.json`` as ``{"role": "prefill" | "decode" | "router", "pid", "url",
"restarts"}``. Once up, the deployment is supervised like the pool (``supervise.Supervisor``): a
process that exits or stops answering ``/health`` (the router too) is named, killed and restarted
on the same port, at most ``inference.max_restarts`` times; past that ``failure`` names it and the
P/D client stops the job with it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from ..processes import ManagedProcess, ProcessTable
from ..supervise import Supervisor
from .vllm_client import InferenceServerError

log = logging.getLogger("primerl.inference")

NIXL_SIDE_CHANNEL_BASE = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT of the i-th vLLM server: this + i


def pd_servers(cfg) -> list[tuple[str, str, int]]:
    """-> [(role, host, port)]: the prefill servers, then the decode servers."""
    p = cfg.inference.pd
    roles = ["prefill"] * p.prefill + ["decode"] * p.decode
    return [(role, p.host, p.base_port + i) for i, role in enumerate(roles)]


def router_command(cfg, prefill_urls: list[str], decode_urls: list[str]) -> list[str]:
    p = cfg.inference.pd
    exe = p.router or str(Path(sys.executable).parent / "vllm-router")
    cmd = [exe, "--vllm-pd-disaggregation"]
    for u in prefill_urls:
        cmd += ["--prefill", u]
    for u in decode_urls:
        cmd += ["--decode", u]
    return cmd + ["--host", p.host, "--port", str(p.router_port), "--policy", p.policy,
                  "--prometheus-host", p.host, "--prometheus-port", str(p.router_metrics_port)]


def embedded_command(config_path: str, role: str, host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "primerl.runtime.cli", "inference", "--config", str(config_path), "--role", role,
            "--host", host, "--port", str(port)]


def embedded_pd_commands(cfg) -> list[tuple[str, list[str], dict[str, str]]]:
    """The ``primerl inference --role`` servers of ``inference.pd`` and the router: [(role, argv, {})];
    the servers read the job's resolved config, written here to ``<output_dir>/pd/config.toml``."""
    from ..config import to_toml

    conf = Path(cfg.output_dir) / "pd" / "config.toml"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(to_toml(cfg))
    servers = pd_servers(cfg)
    cmds = [(role, embedded_command(str(conf), role, h, p), {}) for role, h, p in servers]
    urls = {r: [f"http://{h}:{p}" for rr, h, p in servers if rr == r] for r in ("prefill", "decode")}
    return cmds + [("router", router_command(cfg, urls["prefill"], urls["decode"]), {})]


def vllm_pd_commands(cfg, *, checkpoint: str | None = None,
                     kv_buffer_device: str | None = None) -> list[tuple[str, list[str], dict[str, str]]]:
    """The vLLM servers of ``inference.pd``: [(role, argv, extra environment)], then the router's.

    ``kv_buffer_device`` (default: ``cuda`` where a GPU is visible, else ``cpu``) goes into the
    ``--kv-transfer-config``: vLLM's CPU build registers its KV cache with NIXL as host memory and
    accepts only ``cpu`` there (it also needs the ``nixl`` package, published for CUDA only)."""
    import torch

    from .vllm_launch import vllm_env, vllm_serve_command, wants_routing

    if kv_buffer_device is None:
        kv_buffer_device = "cuda" if torch.cuda.is_available() else "cpu"
    out = []
    servers = pd_servers(cfg)
    for i, (role, host, port) in enumerate(servers):
        v = dataclasses.replace(cfg.inference.vllm, host=host, port=port, disaggregation=role)
        env = {**vllm_env(v), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_CHANNEL_BASE + i),
               "VLLM_NIXL_SIDE_CHANNEL_HOST": host}
        argv = vllm_serve_command(v, cfg.model, checkpoint=checkpoint, routing=wants_routing(cfg))
        i_kv = argv.index("--kv-transfer-config") + 1
        argv[i_kv] = json.dumps({**json.loads(argv[i_kv]), "kv_buffer_device": kv_buffer_device})
        out.append((role, argv, env))
    urls = {r: [f"http://{h}:{p}" for rr, h, p in servers if rr == r] for r in ("prefill", "decode")}
    out.append(("router", router_command(cfg, urls["prefill"], urls["decode"]), {}))
    return out


def _healthy(url: str) -> bool:
    """``GET /health`` answers 200 (the router's body is plain text, the servers' JSON)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class PDDeployment:
    """The job's P/D processes. ``start()`` returns once the router answers ``/health`` (or raises
    naming the process that failed, with the end of its log); ``stop()`` ends them all."""

    def __init__(self, cfg, commands: list[tuple[str, list[str], dict[str, str]]] | None = None):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.commands = commands if commands is not None else self._commands()
        self.procs: list[tuple[str, str, ManagedProcess]] = []
        self.supervisor: Supervisor | None = None
        self.on_up = None  # called with a restarted process once it answers /health (the client: its weights)
        self.restart_env = None  # a restarted process's extra environment (the client: the weights version to wait for)

    @property
    def failure(self) -> str | None:
        """Why the deployment cannot go on (a process died past ``inference.max_restarts``), or None."""
        return self.supervisor.failure if self.supervisor is not None else None

    @property
    def restarts(self) -> int:
        return self.supervisor.restarts if self.supervisor is not None else 0

    def check_now(self) -> None:
        """A supervision pass now (a client met a failure: the process that died is named first)."""
        if self.supervisor is not None:
            self.supervisor.check_once()

    def wait_up(self, timeout: float) -> bool:
        """Every process up again after a restart (``supervise.Supervisor.wait_up``)."""
        return self.supervisor.wait_up(timeout) if self.supervisor is not None else True

    def _commands(self):
        from .backend import get_backend

        return get_backend(self.cfg).pd_commands(self.cfg)  # embedded_pd_commands or vllm_pd_commands

    @property
    def router_url(self) -> str:
        p = self.cfg.inference.pd
        return f"http://{p.host}:{p.router_port}"

    @property
    def server_urls(self) -> list[str]:
        return [f"http://{h}:{p}" for _, h, p in pd_servers(self.cfg)]

    def start(self) -> "PDDeployment":
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        urls = self.server_urls + [self.router_url]
        env0 = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(self.cfg.threads))}
        env0.pop("PRIMERL_HEARTBEAT_DIR", None)  # supervised here (Supervisor), not by the launcher's watchdog
        table = ProcessTable(self.out / "processes.json", merge=True)
        seen: dict[str, int] = {}
        try:
            for (role, argv, env), url in zip(self.commands, urls):
                if role == "router":  # the router waits for healthy workers itself; start it last
                    for (r, u, p) in self.procs:
                        self._wait(r, u, p)
                k = seen[role] = seen.get(role, -1) + 1
                name = role if role == "router" else f"{role}-{k}"
                proc = ManagedProcess(name, role, argv, logs / f"{name}.log", env={**env0, **env}, url=url, table=table)
                self.procs.append((role, url, proc.start()))
            self._wait(*self.procs[-1])
        except BaseException:
            self.stop()
            raise
        i = self.cfg.inference
        embedded = ("prefill", "decode") if all("primerl.runtime.cli" in a for r, a, _ in self.commands
                                                if r != "router") else ()
        self.supervisor = Supervisor([p for _, _, p in self.procs], max_restarts=i.max_restarts,
                                     health_timeout_s=i.health_timeout_s, startup_timeout_s=i.pd.launch_timeout_s,
                                     on_up=lambda p: self.on_up(p) if self.on_up is not None else None,
                                     restart_env=lambda p: self.restart_env(p) if self.restart_env is not None else {},
                                     python_roles=embedded).start()
        log.info("P/D deployment up: router %s, prefill+decode %s", self.router_url, self.server_urls)
        return self

    def _wait(self, role: str, url: str, proc: ManagedProcess) -> None:
        timeout = self.cfg.inference.pd.launch_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                from ..lifetime import log_tail as _tail

                from ..supervise import describe_exit

                raise InferenceServerError(f"the {role} process {proc.name} (pid {proc.pid}, {url}) "
                                           f"{describe_exit(proc.returncode)} before answering /health; end of "
                                           f"{proc.log_path}:\n{_tail(proc.log_path)}")
            if _healthy(url):
                return
            if time.monotonic() > deadline:
                raise InferenceServerError(f"the {role} process ({url}) did not answer /health within {timeout} s "
                                           "(inference.pd.launch_timeout_s)")
            time.sleep(0.3)

    def stop(self, grace: float = 10.0) -> None:
        import signal

        if self.supervisor is not None:
            self.supervisor.stop()
        for _, _, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for _, _, p in self.procs:
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        self.procs = []
