"""The engine server's route table, free of any HTTP front end: ``RouteTable.route(method, path,
body, headers)`` -> ``(status, body)`` or a ``Pending`` engine call whose result is the body.

GET: ``/health`` (200, or 503 once the engine thread died, or while a restarted server waits for
the job's weights: :meth:`RouteTable.waiting_for_weights`, which also answers the sampling routes
503), ``/v1/models``, ``/metrics``
(Prometheus text), ``/is_paused``, ``/kv_transfer/<id>`` (``pd_leg``). POST (a JSON object body):
``/inference/v1/generate`` (``generate_api``; ``X-Session-ID`` recorded in ``sessions``),
``/v1/completions`` (primerl's vLLM client protocol), ``/v1/score`` (prefill only: one log-prob per
given token, and with ``top_k`` each position's k most likely tokens; ``generate_api.parse_score_request``;
the distillation teacher's route),
``/collective_rpc``, ``/pause``, ``/resume`` (``weight_rpcs``), ``/reset_prefix_cache`` (a no-op: no
prefix cache). Anything else: 404 naming it. A bad request raises ValueError (incl.
``GenerateRequestError``), KeyError or TypeError, which the front ends answer 400.
"""

from __future__ import annotations

import os

from .engine_thread import EngineThread, Pending
from .generate_api import (
    generate_response, models_response, parse_completion_request, parse_generate_request, parse_score_request,
    score_response
)
from .pd import KV_ROUTE
from .pd_leg import PDLeg
from .server_metrics import ServerStats, render_prometheus
from .sessions import SESSION_HEADER, SessionStore
from .vllm_client import encode_routed_experts
from .weight_rpcs import WeightRPCs

# set by the supervisor that restarts a server (``pd_client``): the job's weights version at that moment
MIN_WEIGHTS_ENV = "PRIMERL_MIN_WEIGHTS_VERSION"
WAITING_STATUS = "waiting for weights"
SAMPLING_ROUTES = ("/inference/v1/generate", "/v1/completions", "/v1/score")


class RouteTable:
    """Maps each route to the piece that serves it, and turns the engine's ``Completion`` into the
    route's response body."""

    def __init__(self, engine_thread: EngineThread, pd: PDLeg, weights: WeightRPCs, sessions: SessionStore,
                 stats: ServerStats, *, model_name: str, max_model_len: int, server_url: str = ""):
        self.engine_thread = engine_thread
        self.server_url = server_url  # named in each completion ("server"): through a router, who sampled it
        self.pd = pd
        self.weights = weights
        self.sessions = sessions
        self.stats = stats
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.min_version = int(os.environ.get(MIN_WEIGHTS_ENV, "0") or 0)  # a restarted server's: waiting_for_weights

    @property
    def vocab_size(self) -> int:
        return self.engine_thread.engine.cfg.vocab_size

    def waiting_for_weights(self) -> str | None:
        """Why this server must not sample yet, or None: restarted by its supervisor while the job's
        weights were at version ``PRIMERL_MIN_WEIGHTS_VERSION``, it has not loaded them yet (it
        would sample from its initial weights)."""
        have = self.weights.version()
        if have >= self.min_version:
            return None
        return (f"waiting for weights: restarted while the job's weights were at version {self.min_version}, it "
                f"holds version {have}")

    def route(self, method: str, path: str, body: dict | None, headers) -> tuple[int, dict] | Pending:
        """One HTTP request -> (status, body), or a ``Pending`` engine call whose result is the body.
        Raises ValueError (incl. GenerateRequestError) for a bad request (HTTP 400)."""
        path = path.split("?")[0]
        if method == "POST" and path in SAMPLING_ROUTES and self.waiting_for_weights():
            return 503, {"error": self.waiting_for_weights()}
        if method == "GET":
            if path == "/health":
                return self.health()
            if path == "/v1/models":
                return 200, self.models()
            if path == "/metrics":
                return 200, render_prometheus(self.stats.read())
            if path == "/is_paused":
                return 200, {"is_paused": self.weights.is_paused()}
            if path.startswith(KV_ROUTE):
                return self.pd.serve_pull(path)
            return 404, {"error": f"no route GET {path}"}
        if not isinstance(body, dict):
            raise ValueError(f"the body of POST {path} must be a JSON object, got {type(body).__name__}")
        if path == "/inference/v1/generate":
            return self.start_generate(body, headers.get(SESSION_HEADER))
        if path == "/v1/completions":
            return self.start_completion(body)
        if path == "/v1/score":
            return self.start_score(body)
        if path == "/collective_rpc":
            return self.weights.collective_rpc(body)
        if path == "/reset_prefix_cache":
            return 200, {"success": True}
        if path == "/pause":
            return self.weights.start_pause()
        if path == "/resume":
            return self.weights.start_resume()
        return 404, {"error": f"no route POST {path}"}

    # ---------------------------------------------------------------- GET
    def health(self) -> tuple[int, dict]:
        """``GET /health``: 200 ``{"status": "ok", ...ServerStats}`` (plus ``pd`` for a prefill or
        decode server), 503 ``"engine dead"`` once the engine thread died."""
        ok = self.engine_thread.error is None
        waiting = self.waiting_for_weights()
        out = {"status": "ok" if ok else "engine dead", **self.stats.read()}
        if ok and waiting:  # not 200: a router does not send it requests; its supervisor hands it the weights
            out["status"], out["waiting"] = WAITING_STATUS, waiting
            return 503, out
        pd = self.pd.health()
        if pd is not None:
            out["pd"] = pd
        return (200 if ok else 503), out

    def models(self) -> dict:
        return models_response(self.model_name, self.max_model_len)

    # ---------------------------------------------------------------- generation
    def start_completion(self, body: dict) -> Pending:
        """``POST /v1/completions``: primerl's vLLM client protocol."""
        rid = self.engine_thread.new_id()
        prompt, params = parse_completion_request(body, max_model_len=self.max_model_len, default_seed=rid,
                                                  vocab_size=self.vocab_size)

        def finish(c) -> dict:
            choice = {"index": 0, "text": "", "token_ids": c.tokens, "finish_reason": c.finish_reason,
                      "logprobs": {"tokens": [f"token_id:{t}" for t in c.tokens], "token_logprobs": c.logprobs}}
            if c.routing is not None:  # as vLLM with --enable-return-routed-experts: base64 of np.save bytes
                choice["routed_experts"] = encode_routed_experts(c.routing)
            if body.get("return_token_times"):  # bench/pd.py: when each token was sampled (time.monotonic)
                choice["token_times"] = c.token_times
            out = {"id": f"cmpl-{rid}", "object": "text_completion", "choices": [choice],
                   "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(c.tokens)}}
            if self.server_url:  # beyond vLLM's body: the router passes it through to the client
                out["server"] = self.server_url
            return out if extra is None else {**out, **extra(c)}

        fut, extra = self.pd.submit(body, rid, prompt, params)
        return Pending(fut, finish, rid)

    def start_score(self, body: dict) -> Pending:
        """``POST /v1/score``: the engine's model scores the given tokens (one prefill forward, run on
        the engine thread between two steps) -> ``generate_api.score_response``."""
        from .teacher import score_logprobs, score_topk

        seqs, temperature, top_k = parse_score_request(body, max_model_len=self.max_model_len,
                                                       vocab_size=self.vocab_size)
        engine = self.engine_thread.engine

        def score():
            if not top_k:
                return score_logprobs(engine.model, seqs, temperature=temperature), engine.policy_version, None
            rows = score_topk(engine.model, seqs, top_k, temperature=temperature)
            return [lp for lp, _, _ in rows], engine.policy_version, [(ids, lps) for _, ids, lps in rows]

        return Pending(self.engine_thread.call(score), lambda r: score_response(*r))

    def start_generate(self, body: dict, session_id: str | None = None) -> Pending:
        """``POST /inference/v1/generate`` (``generate_api``); with a ``session_id`` the request is
        recorded in ``sessions``."""
        rid = self.engine_thread.new_id()
        prompt, params, start = parse_generate_request(body, max_model_len=self.max_model_len, default_seed=rid,
                                                       vocab_size=self.vocab_size)

        def finish(c) -> dict:
            if session_id and extra is None:  # a prefill leg is recorded by its decode leg
                self.record_session(session_id, c)
            out = generate_response(f"gen-{rid}", c, start)
            return out if extra is None else {**out, **extra(c)}

        fut, extra = self.pd.submit(body, rid, prompt, params)
        return Pending(fut, finish, rid)

    def record_session(self, session_id: str, c) -> None:
        """Record a finished generate request's ``Completion`` (prompt [P], tokens [T], log-probs [T],
        policy versions) under ``session_id``."""
        self.sessions.record(session_id, c.prompt, c.tokens, c.logprobs, c.policy_version, c.policy_version_end)


__all__ = ["RouteTable"]
