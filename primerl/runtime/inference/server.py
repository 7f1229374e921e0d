"""``primerl inference``: the embedded engine behind the same HTTP protocol as vLLM.

Endpoints: ``GET /health``; ``GET /v1/models`` (the served model with ``max_model_len``);
``POST /inference/v1/generate`` (vLLM's token-in / token-out route, what verifiers' train client
calls: ``generate_api``); ``POST /v1/completions`` (token ids in, token ids + log-probs + routed
experts out, as primerl's vLLM client reads them); ``POST /collective_rpc`` with
``update_weights_from_path`` (the filesystem weight update), ``init_broadcast`` +
``update_weights_from_broadcast`` (trainer rank 0's broadcast, ``weight_broadcast``) or ``weights_version``; ``POST
/reset_prefix_cache`` (a no-op: no prefix cache); ``POST /v1/score`` (prefill only: one log-prob per
given token; ``primerl inference --role teacher`` serves ``distill.teacher``'s model for it). One
engine thread runs continuous batching over every in-flight HTTP request.

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

``EngineServer`` wires one object per job: ``engine_thread`` (``engine_thread.EngineThread``: the
only thread that touches the engine), ``routes`` (``http_routes.RouteTable``: every route above),
``pd`` (``pd_leg.PDLeg``: the prefill / decode legs and KV pulls), ``weights``
(``weight_rpcs.WeightRPCs``: pause / resume / weight loads / version), ``sessions``
(``sessions.SessionStore``, shared with ``generate_proxy``), and a front end (``http_aiohttp`` or
``http_stdlib``).
"""

from __future__ import annotations

import logging
import os

from .engine import InferenceEngine
from .engine_thread import EngineThread, Pending
from .http_routes import RouteTable
from .pd import PDState
from .pd_leg import PDLeg
from .server_metrics import ServerStats
from .sessions import SessionRecord, SessionStore
from .weight_rpcs import WeightRPCs

log = logging.getLogger("primerl.inference")


def http_frontends() -> list[str]:
    """The HTTP front ends usable in this environment, preferred first."""
    try:
        import aiohttp.web  # noqa: F401
    except ImportError:
        return ["stdlib"]
    return ["aiohttp", "stdlib"]


class EngineServer:
    """``engine`` served on ``host:port`` (0: any free port) by the ``http`` front end, as a
    prefill / decode / colocated (``role``) server. Bound in the constructor; ``start()`` serves."""

    def __init__(self, engine: InferenceEngine, host: str = "127.0.0.1", port: int = 0, *,
                 request_timeout: float = 300.0, model_name: str = "primerl", max_model_len: int | None = None,
                 http: str | None = None, role: str = "both"):
        self.engine = engine
        pd_state = PDState(role)
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
        self.stats = ServerStats()
        self.sessions = SessionStore()
        self.engine_thread = EngineThread(engine, self.stats)
        if http == "stdlib":
            from .http_stdlib import StdlibFrontend

            self._frontend = StdlibFrontend(self, host, port)
        else:
            from .http_aiohttp import AiohttpFrontend

            self._frontend = AiohttpFrontend(self, host, port)
        self.host, self.port = self._frontend.host, self._frontend.port
        self.url = f"http://{self.host}:{self.port}"
        self.pd = PDLeg(pd_state, self.engine_thread, self.host, self.port)
        self.weights = WeightRPCs(self.engine_thread, request_timeout)
        self.routes = RouteTable(self.engine_thread, self.pd, self.weights, self.sessions, self.stats,
                                 model_name=model_name, max_model_len=self.max_model_len, server_url=self.url)
        self._http_thread = None
        log.info("engine server on %s (%s)", self.url, http)

    # ---------------------------------------------------------------- what the front ends call
    def route(self, method: str, path: str, body: dict | None, headers) -> tuple[int, dict] | Pending:
        """``RouteTable.route``: (status, body) or a ``Pending`` engine call; ValueError -> HTTP 400."""
        return self.routes.route(method, path, body, headers)

    def abort(self, pending: Pending) -> None:
        """Cancel a generation whose client is gone (no-op for a call, or once it finished)."""
        if pending.rid is not None:
            self.engine_thread.abort(pending.rid)

    # ---------------------------------------------------------------- sessions (as GenerateProxy's)
    def pop_session(self, session_id: str) -> SessionRecord | None:
        """The session's record (and forget it), or None if it made no generate request."""
        return self.sessions.pop(session_id)

    def session_versions(self, session_id: str, *, pop: bool = True) -> tuple[int, int, int] | None:
        """(oldest policy version, newest, generate requests) of a session, or None if it made none."""
        return self.sessions.versions(session_id, pop=pop)

    # ---------------------------------------------------------------- for the verifiers orchestrator
    def call_in_engine(self, fn, timeout: float):
        """Run ``fn`` on the engine's thread between two steps (a weight load); its result."""
        return self.engine_thread.call_and_wait(fn, timeout)

    @property
    def engine_error(self) -> BaseException | None:
        """What killed the engine's thread, or None while it runs."""
        return self.engine_thread.error

    # ---------------------------------------------------------------- lifetime
    def start(self) -> "EngineServer":
        self.engine_thread.start()
        self._http_thread = self._frontend.start()
        return self

    def stop(self) -> None:
        self.engine_thread.stop()
        self._frontend.stop()


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

    from ..config import load_policy_env

    from ..lifetime import setup_logging
    from ..placement import resolve_placement
    from ..policy import build_model

    setup_logging("inference")
    from ..heartbeat import install

    install("inference")  # progress: each request finished (engine_thread); stacks on SIGUSR1
    torch.set_num_threads(cfg.threads)
    env = load_policy_env(cfg)
    i = cfg.inference
    placement = resolve_placement(cfg)
    device = server_device(placement.device, i.gpu_ids, int(os.environ.get("PRIMERL_SERVER_INDEX", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if role == "teacher":  # the distillation teacher (distill.teacher) instead of the policy: POST /v1/score
        from .teacher import load_teacher, resolve_teacher

        if not cfg.distill.teacher:
            raise SystemExit("primerl inference --role teacher: set distill.teacher (the teacher to serve)")
        model = load_teacher(resolve_teacher(cfg.distill.teacher), device=device, dtype=placement.param_dtype)
        engine = InferenceEngine(model, max_batch_size=i.max_batch_size, kv_cache=i.kv_cache, capture_routing=False,
                                 kv_cache_gb=i.kv_cache_gb)
    else:
        engine = InferenceEngine(build_model(cfg, env.vocab_size, device=device, dtype=placement.param_dtype),
                                 max_batch_size=i.max_batch_size, kv_cache=i.kv_cache,
                                 capture_routing=i.capture_routing, fp8_experts=i.fp8_experts,
                                 router_noise=i.router_noise, kv_cache_gb=i.kv_cache_gb)
    srv = EngineServer(engine, host, port, request_timeout=i.timeout_s,
                       role="both" if role == "teacher" else role).start()
    print(f"primerl inference: serving on {srv.url}" + ("" if role == "both" else f" (role {role})"), flush=True)
    try:
        srv._http_thread.join()
    except KeyboardInterrupt:
        srv.stop()
