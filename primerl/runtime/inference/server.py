"""``primerl inference``: the embedded engine behind the same HTTP protocol as the vLLM client.

Endpoints: ``GET /health``, ``POST /v1/completions`` (token ids in, token ids + log-probs +
routed experts out), ``POST /collective_rpc`` with ``update_weights_from_path`` (the filesystem
weight update), ``POST /reset_prefix_cache`` (a no-op: no prefix cache). One engine thread runs
continuous batching over every in-flight HTTP request.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .engine import InferenceEngine, Request, SamplingParams
from .vllm_client import encode_routed_experts

log = logging.getLogger("primerl.inference")


class EngineServer:
    def __init__(self, engine: InferenceEngine, host: str = "127.0.0.1", port: int = 0, *, request_timeout: float = 300.0):
        self.engine = engine
        self.request_timeout = request_timeout
        self._incoming: queue.Queue = queue.Queue()
        self._futures: dict[int, Future] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._engine_error: BaseException | None = None
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        self.url = f"http://{self.host}:{self.port}"

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
                            fut.set_exception(e)
                    else:  # a weight update runs between engine steps
                        try:
                            fut.set_result(payload())
                        except Exception as e:  # noqa: BLE001
                            fut.set_exception(e)
                if not self.engine.has_unfinished():
                    self._stop.wait(0.002)
                    continue
                for c in self.engine.step():
                    f = self._futures.pop(c.request_id, None)
                    if f is not None:
                        f.set_result(c)
        except BaseException as e:  # noqa: BLE001 - every waiter gets the error
            self._engine_error = e
            log.exception("engine thread died")
            for f in self._futures.values():
                f.set_exception(e)

    def _call_in_engine(self, fn, timeout: float):
        fut: Future = Future()
        self._incoming.put(("call", fn, fut))
        return fut.result(timeout)

    def complete(self, body: dict) -> dict:
        if self._engine_error is not None:
            raise RuntimeError(f"inference engine is dead: {self._engine_error!r}")
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt must be a list of token ids")
        with self._lock:
            self._next_id += 1
            rid = self._next_id
        params = SamplingParams(max_new_tokens=int(body.get("max_tokens", 16)), temperature=float(body.get("temperature", 1.0)),
                                top_p=float(body.get("top_p", 1.0)), stop_token_ids=tuple(body.get("stop_token_ids") or ()),
                                seed=int(body.get("seed", rid)))
        fut: Future = Future()
        self._incoming.put(("request", Request(rid, prompt, params), fut))
        c = fut.result(self.request_timeout)
        choice = {"index": 0, "text": "", "token_ids": c.tokens, "finish_reason": c.finish_reason,
                  "logprobs": {"tokens": [f"token_id:{t}" for t in c.tokens], "token_logprobs": c.logprobs}}
        if c.routing is not None:  # as vLLM with --enable-return-routed-experts: base64 of np.save bytes
            choice["routed_experts"] = encode_routed_experts(c.routing)
        return {"id": f"cmpl-{rid}", "object": "text_completion", "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(c.tokens)}}

    def update_weights_from_path(self, path: str) -> dict:
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

        self._call_in_engine(load, timeout=self.request_timeout)
        return {"version": version}

    # ---------------------------------------------------------------- HTTP
    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):  # quiet
                log.debug(fmt, *args)

            def _send(self, code: int, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/health":
                    ok = server._engine_error is None
                    self._send(200 if ok else 503, {"status": "ok" if ok else "engine dead"})
                else:
                    self._send(404, {"error": f"no route {self.path}"})

            def do_POST(self):
                try:
                    n = int(self.headers.get("Content-Length", 0))
                    body = json.loads(self.rfile.read(n) or b"{}")
                    if self.path == "/v1/completions":
                        self._send(200, server.complete(body))
                    elif self.path == "/collective_rpc":
                        if body.get("method") != "update_weights_from_path":
                            self._send(400, {"error": f"unknown method {body.get('method')!r}"})
                            return
                        self._send(200, {"results": [server.update_weights_from_path(*body.get("args", []))]})
                    elif self.path.split("?")[0] == "/reset_prefix_cache":
                        self._send(200, {"success": True})
                    else:
                        self._send(404, {"error": f"no route {self.path}"})
                except (ValueError, KeyError, TypeError) as e:
                    self._send(400, {"error": str(e)})
                except Exception as e:  # noqa: BLE001
                    self._send(500, {"error": repr(e)})

        return Handler

    def start(self) -> "EngineServer":
        self._engine_thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        self._engine_thread.start()
        self._http_thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)
        self._http_thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def serve(cfg, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Blocking: the config's model in an embedded engine, served until interrupted."""
    import torch

    from primerl.rl.envs import load_environment

    from ..job import setup_logging
    from ..placement import resolve_placement
    from ..policy import build_model

    setup_logging("inference")
    torch.set_num_threads(cfg.threads)
    env = load_environment(cfg.env.id, **cfg.env.args)
    i = cfg.inference
    placement = resolve_placement(cfg)  # on GPUs: the first of inference.gpu_ids (default GPU 0)
    device = torch.device("cuda", (i.gpu_ids or [0])[0]) if placement.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    engine = InferenceEngine(build_model(cfg, env.vocab_size, device=device, dtype=placement.param_dtype),
                             max_batch_size=i.max_batch_size, kv_cache=i.kv_cache, capture_routing=i.capture_routing,
                             fp8_experts=i.fp8_experts, router_noise=i.router_noise, kv_cache_gb=i.kv_cache_gb)
    srv = EngineServer(engine, host, port, request_timeout=i.timeout_s).start()
    print(f"primerl inference: serving on {srv.url}", flush=True)
    try:
        srv._http_thread.join()
    except KeyboardInterrupt:
        srv.stop()
