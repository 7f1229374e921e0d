"""The inference client the orchestrator samples through, made by the job's inference backend
(``inference.backend.get_backend(cfg).make_client``): the embedded engine (in this process), one
vLLM server, a pool of servers behind vllm-router, or a P/D deployment (prefill and decode servers,
started here). The functions below are the backends' building blocks."""

from __future__ import annotations

import logging
import os

import torch

from ..config import RLConfig
from ..placement import resolve_placement
from ..transport import INFERENCE_POOL_ENV

log = logging.getLogger("primerl")

__all__ = ["make_client", "make_embedded_client", "make_pd_client", "make_pool_client", "make_vllm_client",
           "server_client"]


def make_client(cfg: RLConfig, vocab_size: int, pool: dict | None = None):
    """The orchestrator's client for ``cfg`` (``InferenceBackend.make_client`` of ``inference.backend``)."""
    from ..inference.backend import get_backend

    return get_backend(cfg).make_client(cfg, vocab_size, pool=pool)


def server_client(cfg: RLConfig, vocab_size: int, pool: dict | None, *, pool_routing: bool, pd_routing: bool):
    """The client of servers started around the orchestrator, whatever the backend: P/D
    (``inference.pd``), or the job's server pool (``pool``, or ``PRIMERL_INFERENCE_POOL`` set by the
    launcher). None: the backend's own single client. ``*_routing``: whether those servers return
    routed experts (checked on every completion)."""
    if cfg.inference.pd.enabled:
        return make_pd_client(cfg, vocab_size, expect_routing=pd_routing)
    if pool is None and os.environ.get(INFERENCE_POOL_ENV):  # set by the launcher / `primerl node`
        import json

        pool = json.loads(os.environ[INFERENCE_POOL_ENV])
    if pool is not None:
        return make_pool_client(cfg, vocab_size, pool, expect_routing=pool_routing)
    if cfg.inference.num_servers > 1 or cfg.inference.vllm.urls:
        raise RuntimeError("inference.num_servers > 1 / inference.vllm.urls: the server pool is started by "
                           "`primerl rl` (launch.servers.ServerPool); this process was started without it")
    return None


def make_pool_client(cfg: RLConfig, vocab_size: int, endpoints: dict, *, expect_routing: bool):
    """The client of a server pool (``inference.num_servers`` > 1 or ``inference.vllm.urls``):
    ``endpoints`` is ``launch.servers.ServerPool.endpoints()`` (servers, router, processes.json)."""
    from ..inference.pool_client import PoolClient
    from ..policy import model_config

    mc = model_config(cfg, vocab_size)
    i = cfg.inference
    # a step's requests in flight at once (up to 256 threads): 64 left the servers' batches a quarter
    # full on the main example (2 servers: 1.82 s/step at 64, 1.25 s at 256, bench/RESULTS.md, issue 33)
    client = PoolClient(i.vllm, endpoints["servers"], endpoints["router"], timeout_s=i.timeout_s,
                        output_dir=cfg.output_dir, processes_json=endpoints.get("processes"),
                        health_timeout_s=i.health_timeout_s, num_layers=len(mc.moe_layer_ids), top_k=mc.top_k,
                        expect_routing=expect_routing, broadcast=resolve_placement(cfg).weight_update == "broadcast",
                        concurrency=min(256, max(64, cfg.orchestrator.batch_size * cfg.orchestrator.group_size)))
    client.wait_healthy(cfg.inference.vllm.launch_timeout_s)
    return client


def make_vllm_client(cfg: RLConfig, vocab_size: int):
    """One vLLM-protocol server at ``inference.vllm.url``."""
    from ..inference.vllm_client import VLLMClient
    from ..inference.vllm_launch import wants_routing
    from ..policy import model_config

    mc = model_config(cfg, vocab_size)  # to check routed experts [N, L, k]
    return VLLMClient(cfg.inference.vllm, timeout_s=cfg.inference.timeout_s, output_dir=cfg.output_dir,
                      num_layers=len(mc.moe_layer_ids), top_k=mc.top_k, expect_routing=wants_routing(cfg))


def make_embedded_client(cfg: RLConfig, vocab_size: int):
    """The engine in this process, on the placement's engine device; with weights by broadcast, its
    receiver thread is started here (it hosts the group's store: the trainer connects to it)."""
    from ..inference.engine import InferenceEngine
    from ..policy import build_model
    from .orchestrator import EmbeddedClient

    i = cfg.inference
    placement = resolve_placement(cfg)
    device = placement.engine_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(cfg, vocab_size, device=device, dtype=placement.param_dtype)
    engine = InferenceEngine(model, max_batch_size=i.max_batch_size, kv_cache=i.kv_cache,
                             capture_routing=i.capture_routing, fp8_experts=i.fp8_experts,
                             router_noise=i.router_noise, noise_seed=cfg.seed, kv_cache_gb=i.kv_cache_gb)
    lo = cfg.trainer.lora
    if lo.rank:  # adapter-only updates: the engine takes each version's adapters (engine_lora)
        from ..inference.engine_lora import EngineAdapters

        engine.adapters = EngineAdapters(model, lo.rank, lo.alpha, targets=lo.targets or None, mode=lo.engine)
    log.info("embedded engine on %s in %s; weights by %s%s", device, placement.param_dtype, placement.weight_update,
             f" (LoRA adapters, applied by {lo.engine})" if lo.rank else "")
    receiver = None
    if placement.weight_update == "broadcast":
        from ..inference.weight_sync import engine_broadcast_host
        from ..inference.weight_receive import bucketed_engine_receiver

        sources = cfg.num_trainer_ranks if i.weight_transfer.sharded else 1
        receiver = bucketed_engine_receiver(engine_broadcast_host(), i.broadcast_port, sources=sources,
                                            backend=placement.broadcast_backend, device=device,
                                            timeout_s=cfg.orchestrator.weights_timeout_s)
    return EmbeddedClient(engine, timeout_s=i.timeout_s, receiver=receiver)


def make_pd_client(cfg: RLConfig, vocab_size: int, *, expect_routing: bool):
    """``inference.pd``: start the prefill and decode servers and vllm-router in P/D mode
    (``inference.pd_launch``, the backend's ``pd_commands``), and the client that samples through the
    router; the deployment stops with this process (``client.deployment.stop()`` at exit)."""
    import atexit
    import dataclasses

    from ..inference.pd_client import PDClient
    from ..inference.pd_launch import PDDeployment
    from ..policy import model_config

    dep = PDDeployment(cfg).start()
    atexit.register(dep.stop)
    mc = model_config(cfg, vocab_size)
    v = dataclasses.replace(cfg.inference.vllm, url=dep.router_url)
    client = PDClient(v, dep.server_urls, resamples=cfg.inference.pd.resamples, timeout_s=cfg.inference.timeout_s,
                      output_dir=cfg.output_dir, num_layers=len(mc.moe_layer_ids), top_k=mc.top_k,
                      expect_routing=expect_routing, deployment=dep)
    return client
