"""Inference: the embedded engine and its HTTP server, the vLLM client / launcher / worker extension,
and the trainer-to-engine weight transfer.

Modules (imported lazily: the vLLM worker loads ``inference.vllm_worker`` alone):
  engine       InferenceEngine: continuous batching, KV cache, sampling, log-probs, router capture, FP8 experts
  server       EngineServer / serve: the engine behind vLLM's HTTP API (``primerl inference``), made of
    engine_thread  EngineThread: the one thread that runs the engine (submit, calls between steps, abort, pause)
    http_routes    RouteTable: every route of the server -> (status, body) or a pending engine call
    http_stdlib    the standard library's front end of EngineServer (http_aiohttp: the aiohttp one)
    pd_leg         PDLeg: a request's prefill / decode leg and the KV pulls (the protocol is pd's)
    weight_rpcs    WeightRPCs: /collective_rpc weight loads and version, /pause, /resume
    sessions       SessionStore: what was sampled per X-Session-ID (EngineServer and generate_proxy)
  vllm_client  VLLMClient: requests to a vLLM server, routed experts, weight-update RPCs
  vllm_launch  the ``vllm serve`` command line a config maps to; VLLMLauncher for ``inference.vllm.launch``
  vllm_worker  WeightUpdateExtension: runs inside vLLM's workers, receives and loads weights
  backend      InferenceBackend / BackendCapabilities / BACKENDS: inference.backend -> the backend object
  embedded_backend, vllm_backend  the two built-in backends (they register themselves)
  weight_channels  WeightChannel: how the trainer publishes a version (files, HF files, broadcasts)
  weight_sync  the ends below the channels: BroadcastWeightSender; WeightVersions of the orchestrator
  weight_broadcast  the broadcast's wire protocol (new_group, send_update, receive_update), BroadcastReceiver
  weight_buckets / weight_transfer / weight_receive  the bucketed transfer: wire format, sender (BucketSender),
                  receivers (SourceReceiver, receive_version, PairReceiver, the engine's)
  pool_broadcast  PoolBroadcastSender: a pool's weights, one two-rank group per server
  hf_weights   published weights in the Hugging Face layout (models.checkpoint.hf_layout), FP8 transfer
  generate_api  POST /inference/v1/generate and GET /v1/models: vLLM's token-in / token-out contract
  http_aiohttp  the aiohttp front end of EngineServer (optional extra ``primerl[serve]``)
  server_metrics  ServerStats: the server's /health and /metrics (Prometheus text, prometheus-client)
  aiohttp_thread  AiohttpThread: an aiohttp server with one catch-all route on its own thread (used by
                  http_aiohttp and generate_proxy)
  generate_proxy  GenerateProxy: a recording pass-through in front of vLLM's generate route (verifiers path)

The main classes are re-exported here (``from primerl.runtime.inference import InferenceEngine``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

_EXPORTS = {
    **{name: "engine" for name in ("InferenceEngine", "SamplingParams", "Request", "Completion", "EngineError",
                                   "EngineTimeout", "NonFiniteLogitsError", "sample_next")},
    **{name: "server" for name in ("EngineServer", "serve")},
    "ServerStats": "server_metrics",
    **{name: "vllm_client" for name in ("VLLMClient", "InferenceServerError")},
    "VLLMLauncher": "vllm_launch",
    "WeightUpdateExtension": "vllm_worker",
    **{name: "weight_sync" for name in ("EngineWeightReceiver", "WeightSyncError")},
    **{name: "backend" for name in ("BACKENDS", "BackendCapabilities", "InferenceBackend", "get_backend",
                                    "register_backend")},
    **{name: "weight_channels" for name in ("WeightChannel", "WeightVersions")},
    "Prefilled": "engine",
    **{name: "pd" for name in ("KVTransferError", "PDState")},
    "PDClient": "pd_client",
    **{name: "pd_launch" for name in ("PDDeployment", "vllm_pd_commands")},
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .engine import (Completion, EngineError, EngineTimeout, InferenceEngine, NonFiniteLogitsError,  # noqa: F401
                         Request, SamplingParams, sample_next)
    from .server import EngineServer, serve  # noqa: F401
    from .server_metrics import ServerStats  # noqa: F401
    from .vllm_client import InferenceServerError, VLLMClient  # noqa: F401
    from .vllm_launch import VLLMLauncher  # noqa: F401
    from .vllm_worker import WeightUpdateExtension  # noqa: F401
    from .weight_sync import EngineWeightReceiver, WeightSyncError  # noqa: F401
    from .backend import BACKENDS, BackendCapabilities, InferenceBackend, get_backend, register_backend  # noqa: F401
    from .weight_channels import WeightChannel, WeightVersions  # noqa: F401
    from .engine import Prefilled  # noqa: F401
    from .pd import KVTransferError, PDState  # noqa: F401
    from .pd_client import PDClient  # noqa: F401
    from .pd_launch import PDDeployment, vllm_pd_commands  # noqa: F401


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
