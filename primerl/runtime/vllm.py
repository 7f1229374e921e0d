"""vLLM backend: a token-in / token-out client, routed-experts decoding, weight updates and a launcher.

Protocol (vLLM's OpenAI-compatible server; ``primerl inference`` serves the same one):

- ``POST /v1/completions`` with ``prompt`` = token ids, ``max_tokens``, ``temperature``, ``top_p``,
  ``seed``, ``stop_token_ids``, ``logprobs: 0``, ``return_tokens_as_token_ids``, ``return_token_ids``
  and ``return_routed_experts``. Each choice carries the sampled ids (``token_ids``, or
  ``logprobs.tokens`` as ``"token_id:<id>"`` strings), ``logprobs.token_logprobs``,
  ``finish_reason`` and, with ``--enable-return-routed-experts``, ``routed_experts`` for every
  fed position ``[prompt_len + n - 1, L, k]``: nested lists, a base64 string of int32 values, or
  ``{"shape": [...], "data": base64}`` (all three are decoded by :func:`decode_routed_experts`).
- ``GET /health``; ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``) calls a method of the
  worker extension ``primerl.runtime.vllm_worker.WeightUpdateExtension`` on every worker:
  ``update_weights_from_path(path)`` (filesystem: Hugging Face-named safetensors + ``STABLE``
  marker written by the trainer, ``hf_weights.publish_hf``) or ``init_broadcast`` /
  ``update_weights_from_broadcast`` (a torch.distributed group shared with trainer rank 0, driven
  by the trainer: ``weight_sync.BroadcastWeightSender``). ``POST /reset_prefix_cache`` after every update.

Every HTTP call has a timeout; a dead server raises :class:`InferenceServerError` naming the URL.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .config import ModelConfig, VLLMConfig
from .engine import Completion, Request

WORKER_EXTENSION = "primerl.runtime.vllm_worker.WeightUpdateExtension"


class InferenceServerError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------ decoding
def decode_routed_experts(value, num_layers: int | None = None, top_k: int | None = None) -> torch.Tensor:
    """vLLM's/SGLang's routed experts -> ``[N, L, k]`` uint8/int16/int32 (the smallest unsigned fit)."""
    if isinstance(value, dict):
        shape = [int(s) for s in value["shape"]]
        t = torch.frombuffer(bytearray(base64.b64decode(value["data"])), dtype=torch.int32).view(*shape)
    elif isinstance(value, str):
        if num_layers is None or top_k is None:
            raise ValueError("decode_routed_experts: a base64 payload needs num_layers and top_k")
        t = torch.frombuffer(bytearray(base64.b64decode(value)), dtype=torch.int32).view(-1, num_layers, top_k)
    else:
        t = torch.tensor(value, dtype=torch.int32)
        if t.dim() != 3:
            raise ValueError(f"decode_routed_experts: expected [tokens, layers, top_k] nesting, got shape {tuple(t.shape)}")
    if t.numel() and int(t.min()) < 0:
        raise ValueError("decode_routed_experts: negative expert id")
    top = int(t.max()) if t.numel() else 0
    return t.to(torch.uint8 if top < 256 else torch.int32)


def encode_routed_experts(t: torch.Tensor) -> dict:
    t = t.to(torch.int32).contiguous()
    return {"shape": list(t.shape), "data": base64.b64encode(t.numpy().tobytes()).decode()}


def _token_ids(choice: dict) -> list[int]:
    if choice.get("token_ids") is not None:
        return [int(t) for t in choice["token_ids"]]
    toks = (choice.get("logprobs") or {}).get("tokens")
    if toks is None:
        raise InferenceServerError("response has neither token_ids nor logprobs.tokens (start vLLM with "
                                   "return_tokens_as_token_ids support)")
    return [int(str(t).split(":", 1)[1]) if str(t).startswith("token_id:") else int(t) for t in toks]


# ------------------------------------------------------------------------------------ HTTP
def _http(url: str, payload: dict | None, timeout: float) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if payload is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise InferenceServerError(f"{url}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        raise InferenceServerError(f"{url}: no answer within {timeout} s or connection failed ({e})") from None
    return json.loads(body) if body else {}


class VLLMClient:
    """The orchestrator's inference client for a vLLM server (same interface as EmbeddedClient)."""

    def __init__(self, cfg: VLLMConfig, *, timeout_s: float = 300.0, output_dir: str | None = None,
                 concurrency: int = 64, num_layers: int | None = None, top_k: int | None = None):
        self.cfg, self.url = cfg, cfg.url.rstrip("/")
        self.timeout_s = timeout_s
        self.num_layers, self.top_k = num_layers, top_k
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="vllm")
        self._inflight: dict[int, Future] = {}
        self.version = -1
        self.output_dir = output_dir

    # -- health and weights
    def health(self) -> bool:
        try:
            _http(self.url + "/health", None, timeout=5)
            return True
        except InferenceServerError:
            return False

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                raise InferenceServerError(f"{self.url} did not become healthy within {timeout} s")
            time.sleep(0.5)

    def collective_rpc(self, method: str, *args, timeout: float | None = None) -> dict:
        return _http(self.url + "/collective_rpc", {"method": method, "args": list(args)}, timeout or self.timeout_s)

    def update_weights(self, version: int, transport) -> None:
        if self.cfg.weight_update == "broadcast":
            # the trainer broadcast this version (weight_sync.BroadcastWeightSender) and wrote its
            # marker only after the server confirmed it: nothing to load, the version is recorded
            self.version = version
            return
        path = Path(transport.weights_dir(version)).resolve()
        self.collective_rpc("update_weights_from_path", str(path))
        _http(self.url + "/reset_prefix_cache", {}, timeout=self.timeout_s)
        self.version = version

    # -- generation
    def _payload(self, req: Request) -> dict:
        p = req.params
        return {"model": self.cfg.model or "default", "prompt": list(req.prompt), "max_tokens": p.max_new_tokens,
                "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed % (2**31),
                "stop_token_ids": list(p.stop_token_ids), "logprobs": 0, "return_tokens_as_token_ids": True,
                "return_token_ids": True, "skip_special_tokens": False,
                "return_routed_experts": bool(self.cfg.enable_return_routed_experts)}

    def complete(self, req: Request) -> Completion:
        version = self.version
        out = _http(self.url + "/v1/completions", self._payload(req), timeout=self.timeout_s)
        try:
            choice = out["choices"][0]
        except (KeyError, IndexError):
            raise InferenceServerError(f"{self.url}: malformed completion response: {str(out)[:300]}") from None
        tokens = _token_ids(choice)
        lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        if len(lps) != len(tokens):
            raise InferenceServerError(f"{self.url}: {len(tokens)} tokens but {len(lps)} log-probs")
        routing = None
        if choice.get("routed_experts") is not None:
            routing = decode_routed_experts(choice["routed_experts"], self.num_layers, self.top_k)
            want = len(req.prompt) + len(tokens) - 1
            if routing.shape[0] < want:
                raise InferenceServerError(f"{self.url}: routed_experts covers {routing.shape[0]} positions, need {want}")
            routing = routing[:want]
        reason = "stop" if choice.get("finish_reason") == "stop" else "length"
        return Completion(req.request_id, list(req.prompt), tokens, lps, routing, reason, version, self.version)

    def generate(self, requests: list[Request]) -> list[Completion]:
        return list(self._pool.map(self.complete, requests))

    # -- the orchestrator's client interface
    def submit(self, req: Request) -> None:
        self._inflight[req.request_id] = self._pool.submit(self.complete, req)

    def abort(self, request_ids) -> None:
        for rid in request_ids:
            fut = self._inflight.pop(rid, None)
            if fut is not None:
                fut.cancel()

    def has_pending(self) -> bool:
        return bool(self._inflight)

    def poll(self, wait_s: float = 0.01) -> list[Completion]:
        if not self._inflight:
            return []
        done = [rid for rid, f in self._inflight.items() if f.done()]
        if not done:
            time.sleep(wait_s)
            return []
        return [self._inflight.pop(rid).result() for rid in done]


# ------------------------------------------------------------------------------------ FP8 transfer
def quantize_for_transfer(state_dict: dict[str, torch.Tensor], *, block: tuple[int, int] = (128, 128),
                          match=lambda name: "expert" in name) -> dict[str, torch.Tensor]:
    """Expert weights -> FP8 e4m3 with 128x128 block scales, in the checkpoint layout vLLM's block-FP8
    loader reads (``<name>`` fp8 and ``<name>_scale_inv`` float32). Other tensors pass unchanged."""
    from primerl.kernels.fp8 import quant_per_block

    out = {}
    for name, t in state_dict.items():
        if match(name) and t.is_floating_point() and t.dim() in (2, 3):
            q, sf = quant_per_block(t.float(), block)
            out[name] = q
            out[name + "_scale_inv"] = sf
        else:
            out[name] = t
    return out


# ------------------------------------------------------------------------------------ launcher
def vllm_serve_command(v: VLLMConfig, model: ModelConfig) -> list[str]:
    """The ``vllm serve`` command line for the config's inference section."""
    name = v.model or model.path
    if not name:
        raise ValueError("inference.vllm.model (or model.path) must name the checkpoint vLLM serves")
    cmd = ["vllm", "serve", name, "--host", v.host, "--port", str(v.port),
           "--data-parallel-size", str(v.data_parallel), "--tensor-parallel-size", str(v.tensor_parallel),
           "--gpu-memory-utilization", str(v.gpu_memory_utilization), "--worker-extension-cls", WORKER_EXTENSION,
           "--dtype", model.dtype if model.dtype != "float32" else "bfloat16"]
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
    if v.enable_return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if v.disaggregation:
        role = "kv_both" if v.kv_connector == "NixlConnector" else ("kv_producer" if v.disaggregation == "prefill" else "kv_consumer")
        cmd += ["--kv-transfer-config", json.dumps({"kv_connector": v.kv_connector, "kv_role": role})]
    cmd += [str(a) for a in v.extra_args]
    return cmd


def vllm_env(v: VLLMConfig) -> dict[str, str]:
    """Environment for the server: dev-mode endpoints (collective_rpc) and the all-to-all backend
    for vLLM versions that read it from the environment."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if v.all2all_backend:
        env["VLLM_ALL2ALL_BACKEND"] = v.all2all_backend
    return env


class VLLMLauncher:
    """Start ``vllm serve`` as a child process and wait until /health answers (or fail clearly)."""

    def __init__(self, v: VLLMConfig, model: ModelConfig, *, log_path: str | Path, command: list[str] | None = None):
        self.v, self.cmd = v, command or vllm_serve_command(v, model)
        self.log_path = Path(log_path)
        self.proc = None

    def start(self, timeout: float = 900.0) -> "VLLMLauncher":
        import os
        import subprocess

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, **vllm_env(self.v)), start_new_session=True)
        except FileNotFoundError:
            raise InferenceServerError(f"cannot start {self.cmd[0]!r}: not installed (pip install vllm)") from None
        client = VLLMClient(self.v)
        deadline = time.monotonic() + timeout
        while not client.health():
            if self.proc.poll() is not None:
                raise InferenceServerError(f"vllm serve exited with code {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise InferenceServerError(f"vllm serve did not become healthy within {timeout} s; see {self.log_path}")
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        import os
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except Exception:  # noqa: BLE001
                os.killpg(self.proc.pid, signal.SIGKILL)
