"""``primerl inference``: the embedded engine behind the same HTTP protocol as vLLM.

Endpoints: ``GET /health``; ``GET /v1/models`` (the served model with ``max_model_len``);
``POST /inference/v1/generate`` (vLLM's token-in / token-out route, what verifiers' train client
calls: ``generate_api``); ``POST /v1/completions`` (token ids in, token ids + log-probs + routed
experts out, as primerl's vLLM client reads them); ``POST /collective_rpc`` with
``update_weights_from_path`` (the filesystem weight update), ``init_broadcast`` +
``update_weights_from_broadcast`` (trainer rank 0's broadcast, ``weight_broadcast``) or ``weights_version``; ``POST
/reset_prefix_cache`` (a no-op: no prefix cache). One engine thread runs continuous batching over
every in-flight HTTP request.

In-flight weight updates: ``POST /pause`` stops stepping the engine and keeps every request (queued
and running, with its KV cache); ``POST /resume`` continues; ``GET /is_paused``. A weight update
runs on the engine thread between two steps, paused or not, so running requests continue on the
new weights without recomputing their cache (``Completion.policy_version`` /
``policy_version_end``: the oldest and newest version their tokens came from).

Monitoring (``server_metrics``): ``GET /metrics`` (Prometheus text) and ``GET /health`` (JSON:
status, requests running / waiting, KV-cache use, weights version, generated tokens, paused).

Bad input (malformed JSON, a body that is not an object, empty or out-of-vocabulary token ids,
``max_tokens`` < 1 or past the context, wrong types) is answered 400 with a message naming the
field before anything reaches the engine; the server keeps serving.

Stale work is cancelled on the server: a client that closes its connection before the answer
(``VLLMClient.abort`` does) aborts the request in the engine (aiohttp: the handler is cancelled on
disconnect; stdlib: the handler watches its socket while it waits).

Two HTTP front ends serve the same routes: aiohttp (``http="aiohttp"``; the ``primerl[serve]``
extra, and what ``primerl[verifiers]`` brings) and the standard library's threading server
(``http="stdlib"``, no dependency). ``http=None`` takes aiohttp when it is installed; the choice
is logged and readable as ``server.http``.

Prefill/decode roles (``role="prefill" | "decode"``, ``primerl inference --role``; ``pd``): a request
whose body carries vLLM's ``kv_transfer_params`` is one leg of a disaggregated request as vllm-router's
P/D mode sends it; ``GET /kv_transfer/<id>`` hands a prefilled cache to the decode server once.

Every ``generate`` call with an ``X-Session-ID`` header (verifiers sends the rollout's trace id)
records the policy versions its tokens came from: ``session_versions(id)`` returns
``(oldest, newest, requests)``, so an orchestrator can join them to its samples (the client drops
response fields it does not know).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import select
import socket
import threading
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from .engine import InferenceEngine, Prefilled, Request, SamplingParams
from .pd import KV_ROUTE, PDState, encode_prefilled, prefill_params
from .generate_api import generate_response, models_response, parse_completion_request, parse_generate_request
from .server_metrics import ServerStats, TextBody, render_prometheus
from .vllm_client import encode_routed_experts

log = logging.getLogger("primerl.inference")

SESSION_HEADER = "X-Session-ID"
MAX_SESSIONS = 100_000  # recorded sessions kept (oldest dropped first) when nobody pops them


class SessionRecord:
    """What the server sampled for one ``X-Session-ID``: the policy versions and every request's
    ``(prompt ids, completion ids, log-probs)`` in arrival order."""

    __slots__ = ("first", "last", "requests")

    def __init__(self):
        self.first: int | None = None
        self.last: int | None = None
        self.requests: list[tuple[list[int], list[int], list[float]]] = []


class Pending:
    """A request handed to the engine thread: wait on ``future``, then ``finish(result)`` is the body."""

    def __init__(self, future: Future, finish: Callable[[object], dict], rid: int | None = None):
        self.future, self.finish, self.rid = future, finish, rid


def _settle(fut: Future, result=None, *, error: BaseException | None = None) -> None:
    """Complete ``fut`` unless its waiter cancelled it (a cancelled future refuses a result)."""
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def http_frontends() -> list[str]:
    """The HTTP front ends usable in this environment, preferred first."""
    try:
        import aiohttp.web  # noqa: F401
    except ImportError:
        return ["stdlib"]
    return ["aiohttp", "stdlib"]


class EngineServer:
    def __init__(self, engine: InferenceEngine, host: str = "127.0.0.1", port: int = 0, *, request_timeout: float = 300.0,
                 model_name: str = "primerl", max_model_len: int | None = None, http: str | None = None,
                 role: str = "both"):
        self.engine = engine
        self.pd = PDState(role)
        self.request_timeout = request_timeout
        self.model_name = model_name
        self.max_model_len = int(max_model_len or engine.cfg.max_position_embeddings)
        if self.max_model_len > engine.cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"{engine.cfg.max_position_embeddings}")
        available = http_frontends()
        if http is None:
            http = available[0]
        if http not in ("aiohttp", "stdlib"):
            raise ValueError(f"http must be 'aiohttp' or 'stdlib', got {http!r}")
        if http not in available:
            raise ImportError("EngineServer(http='aiohttp') needs aiohttp: pip install 'primerl[serve]'")
        self.http = http
        self._incoming: queue.Queue = queue.Queue()
        self._futures: dict[int, Future] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._engine_error: BaseException | None = None
        self._paused = False
        self._broadcast = None  # weight_broadcast.BroadcastReceiver once trainer rank 0 asked (init_broadcast)
        self.stats = ServerStats()
        self._sessions: collections.OrderedDict[str, SessionRecord] = collections.OrderedDict()
        if http == "stdlib":
            self.httpd = ThreadingHTTPServer((host, port), self._handler())
            self.httpd.daemon_threads = True
            self.host, self.port = self.httpd.server_address[:2]
        else:
            from .http_aiohttp import AiohttpFrontend

            self._frontend = AiohttpFrontend(self, host, port)
            self.host, self.port = self._frontend.host, self._frontend.port
        self.url = f"http://{self.host}:{self.port}"
        log.info("engine server on %s (%s)", self.url, http)

    # ---------------------------------------------------------------- engine thread
    def _engine_loop(self) -> None:
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        item = self._incoming.get_nowait()
                    except queue.Empty:
                        break
                    kind, payload, fut = item
                    if kind == "request":
                        try:
                            self.engine.add_request(payload)
                            self._futures[payload.request_id] = fut
                        except ValueError as e:
                            _settle(fut, error=e)
                    elif kind == "abort":  # the client went away: free its slot
                        if self._futures.pop(payload, None) is not None:
                            self.engine.abort([payload])
                            self.stats.count("aborted")
                        fut.set_result(None)
                    else:  # a weight update (or pause / resume) runs between engine steps
                        try:
                            _settle(fut, payload())
                        except Exception as e:  # noqa: BLE001
                            _settle(fut, error=e)
                if self._paused or not self.engine.has_unfinished():
                    self.stats.refresh(self.engine, waiting_extra=self._incoming.qsize(), paused=self._paused)
                    self._stop.wait(0.002)
                    continue
                for c in self.engine.step():
                    f = self._futures.pop(c.request_id, None)
                    # a waiter that gave up (aiohttp cancels the wrapped future) is an abort in flight
                    if f is not None and not f.cancelled():
                        f.set_result(c)
                        self.stats.count("finished")
                self.stats.refresh(self.engine, waiting_extra=self._incoming.qsize())
        except BaseException as e:  # noqa: BLE001 - every waiter gets the error
            self._engine_error = e
            log.exception("engine thread died")
            for f in self._futures.values():
                if not f.cancelled():
                    f.set_exception(e)

    def _check_alive(self) -> None:
        if self._engine_error is not None:
            raise RuntimeError(f"inference engine is dead: {self._engine_error!r}")

    def _new_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def _submit(self, rid: int, prompt: list[int], params: SamplingParams) -> Future:
        return self._submit_request(Request(rid, prompt, params))

    def _submit_request(self, req: Request) -> Future:
        self._check_alive()
        fut: Future = Future()
        self._incoming.put(("request", req, fut))
        return fut

    # ---------------------------------------------------------------- prefill/decode legs (pd.py)
    def _pd_leg(self, body: dict, rid: int, prompt: list[int], params: SamplingParams):
        """-> (engine future, extra response fields: callable(Completion) -> dict) for a request, by
        its ``kv_transfer_params``: a prefill leg (do_remote_decode), a decode leg (do_remote_prefill),
        or a plain request (none)."""
        ktp = body.get("kv_transfer_params")
        if ktp is None:
            return self._submit(rid, prompt, params), None
        if not isinstance(ktp, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(ktp).__name__}")
        role = self.pd.role
        if ktp.get("do_remote_decode"):
            if role == "decode":
                raise ValueError("kv_transfer_params.do_remote_decode: this server's role is decode, not prefill")
            import dataclasses

            self.pd.count("prefills")
            fut = self._submit_request(Request(rid, prompt, dataclasses.replace(params, max_new_tokens=1),
                                               export_kv=True))

            def extra(c) -> dict:
                k, v = c.kv
                routing = None if c.routing is None else c.routing[:len(prompt)]
                pf = Prefilled(k.cpu(), v.cpu(), c.tokens[0], c.logprobs[0], routing, c.policy_version,
                               c.token_times[0] if c.token_times else 0.0)
                tid = self.pd.store.put(encode_prefilled(pf, seed=params.seed, prompt=prompt))
                return {"kv_transfer_params": prefill_params(self.host, self.port, self.pd.engine_id, tid)}

            return fut, extra
        if ktp.get("do_remote_prefill"):
            if role == "prefill":
                raise ValueError("kv_transfer_params.do_remote_prefill: this server's role is prefill, not decode")
            import dataclasses

            def check(pf, header):
                if header.get("prompt_len") != len(prompt):
                    raise ValueError(f"the prefilled prompt has {header.get('prompt_len')} tokens, this request's "
                                     f"prompt {len(prompt)}")
                self.engine.check_prefilled(rid, len(prompt), pf)

            def submit(pf, header):
                return self._submit_request(Request(rid, prompt, dataclasses.replace(params, seed=int(header["seed"])),
                                                    prefilled=pf))

            self._check_alive()
            return self.pd.start_decode(ktp, check, submit), None
        return self._submit(rid, prompt, params), None

    def _call_in_engine(self, fn, timeout: float):
        return self._start_call(fn).result(timeout)

    def _start_call(self, fn) -> Future:
        fut: Future = Future()
        self._incoming.put(("call", fn, fut))
        return fut

    def abort(self, pending: "Pending") -> None:
        """Cancel a generation whose client is gone (no-op once it finished). Its future may already
        be cancelled (aiohttp cancels the future it waited on); the engine thread then drops it."""
        if pending.rid is not None:
            self._incoming.put(("abort", pending.rid, Future()))

    def start_pause(self) -> Pending:
        """``POST /pause``: stop stepping the engine (after the step under way), keeping every
        request and its KV cache."""
        def set_paused():
            self._paused = True
        return Pending(self._start_call(set_paused), lambda _: {"status": "paused"})

    def start_resume(self) -> Pending:
        def set_running():
            self._paused = False
        return Pending(self._start_call(set_running), lambda _: {"status": "resumed"})

    # ---------------------------------------------------------------- routes (transport-free)
    def start_completion(self, body: dict) -> Pending:
        """``POST /v1/completions``: primerl's vLLM client protocol."""
        rid = self._new_id()
        prompt, params = parse_completion_request(body, max_model_len=self.max_model_len, default_seed=rid,
                                                  vocab_size=self.engine.cfg.vocab_size)

        def finish(c) -> dict:
            choice = {"index": 0, "text": "", "token_ids": c.tokens, "finish_reason": c.finish_reason,
                      "logprobs": {"tokens": [f"token_id:{t}" for t in c.tokens], "token_logprobs": c.logprobs}}
            if c.routing is not None:  # as vLLM with --enable-return-routed-experts: base64 of np.save bytes
                choice["routed_experts"] = encode_routed_experts(c.routing)
            if body.get("return_token_times"):  # bench/pd.py: when each token was sampled (time.monotonic)
                choice["token_times"] = c.token_times
            out = {"id": f"cmpl-{rid}", "object": "text_completion", "choices": [choice],
                   "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(c.tokens)}}
            return out if extra is None else {**out, **extra(c)}

        fut, extra = self._pd_leg(body, rid, prompt, params)
        return Pending(fut, finish, rid)

    def start_generate(self, body: dict, session_id: str | None = None) -> Pending:
        """``POST /inference/v1/generate`` (``generate_api``)."""
        rid = self._new_id()
        prompt, params, start = parse_generate_request(body, max_model_len=self.max_model_len, default_seed=rid,
                                                       vocab_size=self.engine.cfg.vocab_size)

        def finish(c) -> dict:
            if session_id and extra is None:  # a prefill leg is recorded by its decode leg
                self._record_session(session_id, c)
            out = generate_response(f"gen-{rid}", c, start)
            return out if extra is None else {**out, **extra(c)}

        fut, extra = self._pd_leg(body, rid, prompt, params)
        return Pending(fut, finish, rid)

    def _record_session(self, session_id: str, c) -> None:
        with self._lock:
            rec = self._sessions.pop(session_id, None) or SessionRecord()
            rec.first = c.policy_version if rec.first is None else min(rec.first, c.policy_version)
            rec.last = c.policy_version_end if rec.last is None else max(rec.last, c.policy_version_end)
            rec.requests.append((list(c.prompt), list(c.tokens), list(c.logprobs)))
            self._sessions[session_id] = rec
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)

    def pop_session(self, session_id: str) -> SessionRecord | None:
        """The session's record (and forget it), or None if it made no generate request."""
        with self._lock:
            return self._sessions.pop(session_id, None)

    def session_versions(self, session_id: str, *, pop: bool = True) -> tuple[int, int, int] | None:
        """(oldest policy version, newest, generate requests) of a session, or None if it made none."""
        with self._lock:
            rec = self._sessions.pop(session_id, None) if pop else self._sessions.get(session_id)
        return None if rec is None else (rec.first, rec.last, len(rec.requests))

    def models(self) -> dict:
        return models_response(self.model_name, self.max_model_len)

    def health(self) -> tuple[int, dict]:
        ok = self._engine_error is None
        out = {"status": "ok" if ok else "engine dead", **self.stats.read()}
        if self.pd.role != "both":
            out["pd"] = self.pd.read()
        return (200 if ok else 503), out

    def start_update_weights(self, path: str) -> Pending:
        from primerl.models.checkpoint import read_safetensors

        from .hf_weights import primerl_weights

        d = Path(path)
        sd = read_safetensors(d / "model.safetensors")
        version = int((d / "STABLE").read_text()) if (d / "STABLE").exists() else self.engine.policy_version + 1

        def load():
            # vLLM reads the Hugging Face layout (what the trainer publishes for inference.backend = vllm);
            # primerl's own names are accepted too
            own = sd if "model.embed_tokens.weight" not in sd else primerl_weights(self.engine.model, sd)
            self.engine.load_weights(own, version)

        return Pending(self._start_call(load), lambda _: {"results": [{"version": version}]})

    def start_broadcast_call(self, method: str, args: list) -> Pending:
        """``init_broadcast(host, port, rank_offset, world_size[, timeout_s])`` then
        ``update_weights_from_broadcast()``, as vLLM's worker extension (``vllm_worker``) answers
        them: trainer rank 0 sends the weights over a torch.distributed group (gloo, NCCL on a GPU),
        no file. The join and each receive run on a thread of their own (never the HTTP loop's or
        the engine's); the load runs on the engine thread between steps."""
        from .weight_broadcast import BroadcastReceiver

        if method == "init_broadcast":
            if not 4 <= len(args) <= 5:
                raise ValueError(f"init_broadcast takes (host, port, rank_offset, world_size[, timeout_s]), got {args!r}")
            self._broadcast = BroadcastReceiver(self.engine.device, *args)
            return Pending(self._broadcast.join(), lambda _: {"results": [None]})
        if self._broadcast is None:
            raise ValueError("update_weights_from_broadcast before init_broadcast")

        def load(version, weights):
            from .hf_weights import primerl_weights

            sd = dict(weights)
            own = sd if "model.embed_tokens.weight" not in sd else primerl_weights(self.engine.model, sd)
            self._call_in_engine(lambda: self.engine.load_weights(own, version), self.request_timeout)

        return Pending(self._broadcast.receive(load), lambda version: {"results": [{"version": version}]})

    def update_weights_from_path(self, path: str) -> dict:
        p = self.start_update_weights(path)
        return p.finish(p.future.result(self.request_timeout))["results"][0]

    def complete(self, body: dict) -> dict:
        p = self.start_completion(body)
        return p.finish(p.future.result(self.request_timeout))

    def generate(self, body: dict, session_id: str | None = None) -> dict:
        p = self.start_generate(body, session_id)
        return p.finish(p.future.result(self.request_timeout))

    def route(self, method: str, path: str, body: dict | None, headers) -> tuple[int, dict] | Pending:
        """One HTTP request -> (status, body), or a ``Pending`` engine call whose result is the body.
        Raises ValueError (incl. GenerateRequestError) for a bad request (HTTP 400)."""
        path = path.split("?")[0]
        if method == "GET":
            if path == "/health":
                return self.health()
            if path == "/v1/models":
                return 200, self.models()
            if path == "/metrics":
                return 200, render_prometheus(self.stats.read())
            if path == "/is_paused":
                return 200, {"is_paused": self._paused}
            if path.startswith(KV_ROUTE):
                tid = path[len(KV_ROUTE):]
                data = self.pd.serve_pull(tid)
                if data is None:
                    return 404, {"error": f"unknown KV transfer {tid!r}: never prefilled here, already pulled, "
                                          f"or expired after {self.pd.store.ttl_s:g} s"}
                return 200, BytesBody(data)
            return 404, {"error": f"no route GET {path}"}
        if not isinstance(body, dict):
            raise ValueError(f"the body of POST {path} must be a JSON object, got {type(body).__name__}")
        if path == "/inference/v1/generate":
            return self.start_generate(body, headers.get(SESSION_HEADER))
        if path == "/v1/completions":
            return self.start_completion(body)
        if path == "/collective_rpc":
            if body.get("method") == "weights_version":  # as vLLM's worker extension: one answer per worker
                return 200, {"results": [{"version": self.engine.policy_version}]}
            if body.get("method") in ("init_broadcast", "update_weights_from_broadcast"):
                return self.start_broadcast_call(body["method"], body.get("args", []))
            if body.get("method") != "update_weights_from_path":
                raise ValueError(f"collective_rpc: unknown method {body.get('method')!r}")
            return self.start_update_weights(*body.get("args", []))
        if path == "/reset_prefix_cache":
            return 200, {"success": True}
        if path == "/pause":
            return self.start_pause()
        if path == "/resume":
            return self.start_resume()
        return 404, {"error": f"no route POST {path}"}

    # ---------------------------------------------------------------- stdlib HTTP
    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):  # quiet
                log.debug(fmt, *args)

            def _send(self, code: int, obj) -> None:
                if isinstance(obj, TextBody):
                    body, ctype = obj.data, obj.content_type
                else:  # compact, as vLLM's: the renderers client splices routed_experts.data out by its prefix
                    body, ctype = json.dumps(obj, separators=(",", ":")).encode(), "application/json"
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _serve(self, method: str) -> None:
                try:
                    body = None
                    if method == "POST":
                        n = int(self.headers.get("Content-Length", 0))
                        body = json.loads(self.rfile.read(n) or b"{}")
                    out = server.route(method, self.path, body, self.headers)
                    if isinstance(out, Pending):
                        if not self._wait(out):
                            return
                        out = 200, out.finish(out.future.result(0))
                    self._send(*out)
                except (ValueError, KeyError, TypeError) as e:
                    server.stats.count("bad_request")
                    self._send(400, {"error": str(e)})
                except Exception as e:  # noqa: BLE001
                    server.stats.count("error")
                    self._send(500, {"error": repr(e)})

            def _wait(self, p: Pending) -> bool:
                """Wait for the engine, watching the socket: False (request aborted) if the client
                closed it first. Raises TimeoutError after the server's request timeout."""
                import time
                from concurrent.futures import wait

                deadline = time.monotonic() + server.request_timeout
                while not wait([p.future], timeout=0.05).done:  # answers as soon as the engine does
                    if time.monotonic() > deadline:
                        server.abort(p)
                        raise TimeoutError(f"no result within {server.request_timeout} s")
                    readable, _, _ = select.select([self.connection], [], [], 0)
                    if readable and not self.connection.recv(1, socket.MSG_PEEK):
                        server.abort(p)
                        self.close_connection = True
                        return False
                return True

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        return Handler

    def start(self) -> "EngineServer":
        self._engine_thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        self._engine_thread.start()
        if self.http == "stdlib":
            self._http_thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)
            self._http_thread.start()
        else:
            self._http_thread = self._frontend.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.http == "stdlib":
            self.httpd.shutdown()
            self.httpd.server_close()
        else:
            self._frontend.stop()


class BytesBody(TextBody):
    """A binary response body (a KV hand-off)."""

    def __init__(self, data: bytes):
        self.data, self.content_type = data, "application/octet-stream"


def server_device(device_type: str, gpu_ids, index: int):
    """Server ``index`` of a pool (``PRIMERL_SERVER_INDEX``, set by the launcher) on GPUs takes
    ``inference.gpu_ids[index % len(gpu_ids)]`` (default GPU 0): list one GPU per server to give
    each its own; on the CPU every server is a CPU process."""
    import torch

    if device_type != "cuda":
        return torch.device("cpu")
    ids = list(gpu_ids) or [0]
    return torch.device("cuda", ids[index % len(ids)])


def serve(cfg, host: str = "127.0.0.1", port: int = 8000, role: str = "both") -> None:
    """Blocking: the config's model in an embedded engine, served until interrupted."""
    import torch

    from primerl.rl.envs import load_environment

    from ..lifetime import setup_logging
    from ..placement import resolve_placement
    from ..policy import build_model

    setup_logging("inference")
    torch.set_num_threads(cfg.threads)
    env = load_environment(cfg.env.id, **cfg.env.args)
    i = cfg.inference
    placement = resolve_placement(cfg)
    device = server_device(placement.device, i.gpu_ids, int(os.environ.get("PRIMERL_SERVER_INDEX", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    engine = InferenceEngine(build_model(cfg, env.vocab_size, device=device, dtype=placement.param_dtype),
                             max_batch_size=i.max_batch_size, kv_cache=i.kv_cache, capture_routing=i.capture_routing,
                             fp8_experts=i.fp8_experts, router_noise=i.router_noise, kv_cache_gb=i.kv_cache_gb)
    srv = EngineServer(engine, host, port, request_timeout=i.timeout_s, role=role).start()
    print(f"primerl inference: serving on {srv.url}" + ("" if role == "both" else f" (role {role})"), flush=True)
    try:
        srv._http_thread.join()
    except KeyboardInterrupt:
        srv.stop()
