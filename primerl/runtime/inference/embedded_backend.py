"""``inference.backend = "embedded"``: primerl's own engine (``engine.InferenceEngine``).

One engine in the orchestrator's process (on ``inference.gpu_ids[0]``, or the CPU), or
``primerl inference`` servers started by primerl: a pool behind vllm-router
(``inference.num_servers`` > 1, started by the launcher: ``launch.servers.pool_for_job``) or a P/D
deployment (``inference.pd``, started by the orchestrator's client). Weights: files under primerl's
names, or (``inference.weight_update`` = "broadcast", "auto" on a GPU of its own or an orchestrator
on its own node) a broadcast from trainer rank 0 to the engine's receiver thread. A pool
(``serves_from_pool``: ``inference.num_servers`` > 1, or servers on ``deployment.inference_nodes``,
``inference.num_servers`` on each) takes files, or the bucketed transfer from trainer rank 0 to every
server, one pair each (``pool_broadcast.PoolBroadcastSender`` behind ``weight_channels.BucketedBroadcast``,
FP8 / delta as ``inference.weight_transfer`` says; the orchestrator reads the servers' versions:
``weight_sync.ServerWeightVersions``).
"""

from __future__ import annotations

from .backend import BackendCapabilities, GenerateServer, InferenceBackend, register_backend

__all__ = ["EmbeddedBackend", "serves_from_pool"]


def serves_from_pool(cfg) -> bool:
    """The job samples from a pool of ``primerl inference`` servers behind a router (not the engine in
    the orchestrator): ``inference.num_servers`` > 1 on this machine, or servers on
    ``deployment.inference_nodes`` (``inference.num_servers`` on each)."""
    return cfg.inference.num_servers > 1 or cfg.deployment.inference_nodes > 0


class EmbeddedBackend(InferenceBackend):
    name = "embedded"
    capabilities = BackendCapabilities(pd=True, broadcast=True, routed_experts=True, server_pool=True,
                                       external_servers=False, launch=False, inference_nodes=True,
                                       engine_in_process=True, weight_transfer=True)

    def check(self, cfg) -> None:
        from ..config import ConfigError

        i, d = cfg.inference, cfg.deployment
        if i.vllm.weight_update != "filesystem":
            raise ConfigError(f"inference.vllm.weight_update: {i.vllm.weight_update!r} is vLLM's (inference.backend = "
                              f"'vllm'); the embedded engine's is inference.weight_update (files or broadcast), "
                              f"got {i.vllm.weight_update!r}")
        if d.inference_nodes and i.weight_update == "filesystem":
            raise ConfigError("inference.weight_update: 'filesystem' has the servers load the trainer's files from "
                              "output_dir, which the inference nodes (deployment.inference_nodes) do not share: use "
                              f"'broadcast' or 'auto', got {i.weight_update!r}")
        if d.inference_nodes and i.vllm.port + i.num_servers > 65536:
            raise ConfigError(f"inference.vllm.port: the {i.num_servers} servers of each inference node listen on "
                              f"inference.vllm.port + 0..{i.num_servers - 1}, past 65535, got {i.vllm.port}")
        if d.inference_nodes and i.pd.enabled:
            raise ConfigError("inference.pd: prefill / decode servers run beside the orchestrator, not on "
                              "deployment.inference_nodes (set inference.pd.prefill = decode = 0 or "
                              f"deployment.inference_nodes = 0), got {i.pd.prefill} + {i.pd.decode}")
        if cfg.trainer.lora.rank:  # adapter-only updates: a PEFT directory per version, read from files
            if i.weight_update == "broadcast":
                raise ConfigError("inference.weight_update: with trainer.lora the adapters go as files (a few MB a "
                                  "version); set 'filesystem' or 'auto', got 'broadcast'")
            if i.num_servers > 1 or i.pd.enabled:
                raise ConfigError("inference.num_servers / inference.pd: LoRA updates reach the embedded engine in "
                                  "the orchestrator's process only (one engine, no P/D); unset them or "
                                  "trainer.lora.rank")
        if d.orchestrator == "own" and i.weight_update == "filesystem":
            raise ConfigError("inference.weight_update: 'filesystem' needs output_dir shared by the trainer and the "
                              "orchestrator, which runs on a node of its own (deployment.orchestrator = 'own'): use "
                              f"'broadcast' or 'auto', got {i.weight_update!r}")

    # ------------------------------------------------------------------ descriptions
    def describe(self, cfg) -> str:
        i = cfg.inference
        if i.pd.enabled:
            from .pd_launch import pd_servers

            p = i.pd
            servers = ", ".join(f"{role} {h}:{port}" for role, h, port in pd_servers(cfg))
            return (f"# inference servers (P/D, started by the orchestrator): `primerl inference --role` {servers}; "
                    f"vllm-router --vllm-pd-disaggregation on {p.host}:{p.router_port} (policy {p.policy})\n")
        if cfg.deployment.inference_nodes:
            n = cfg.deployment.inference_nodes
            return (f"# inference servers: {i.num_servers} `primerl inference` server(s) on each of the {n} inference "
                    f"node(s) (ports {i.vllm.port}..{i.vllm.port + i.num_servers - 1}, supervised by the node, "
                    f"max_restarts {i.max_restarts}; see the node lines), behind vllm-router on the orchestrator's "
                    f"node (policy {i.router_policy}); weights by broadcast from trainer rank 0 to all "
                    f"{n * i.num_servers} at once\n")
        if i.num_servers > 1:
            via = "broadcast from trainer rank 0 to all at once" if _broadcast(cfg) else "files in output_dir"
            return (f"# inference servers: {i.num_servers} `primerl inference` servers on free ports of 127.0.0.1 "
                    f"behind vllm-router (policy {i.router_policy}), supervised (max_restarts {i.max_restarts}); "
                    f"weights by {via}\n")
        return "# inference servers: none started (the embedded engine runs in the orchestrator's process)\n"

    def beside_orchestrator(self, cfg) -> str:
        i = cfg.inference
        if i.pd.enabled:
            from .pd_launch import pd_servers

            servers = ", ".join(f"{role} server {h}:{port}" for role, h, port in pd_servers(cfg))
            return f"P/D (started by the orchestrator): {servers}, vllm-router {i.pd.host}:{i.pd.router_port}"
        if i.num_servers > 1:
            return (f"{i.num_servers} inference servers inference-0..{i.num_servers - 1} and a vllm-router (ports "
                    "chosen at start, listed in output_dir/processes.json)")
        return "embedded engine"

    def describe_placement(self, cfg, placement) -> str:
        from ..launch.kinds import get_launcher

        p = placement
        i = cfg.inference
        if i.pd.enabled or serves_from_pool(cfg):  # the engines are the servers', one each
            dtype = p.dtype
            if i.pd.enabled or not cfg.deployment.inference_nodes:
                from .server import server_device

                kind = "cpu" if p.device == "cpu" else "cuda"
                n = i.pd.prefill + i.pd.decode if i.pd.enabled else i.num_servers
                names = ([f"{r}-{k}" for r in ("prefill", "decode") for k in range(getattr(i.pd, r))] if i.pd.enabled
                         else [f"inference-{k}" for k in range(n)])
                devs = ", ".join(f"{name} on {server_device(kind, i.gpu_ids, k)}" for k, name in enumerate(names))
                head = f"# inference: {n} `primerl inference` server processes, each its own embedded engine ({devs})"
            else:
                head = (f"# inference: a pool of {cfg.deployment.inference_nodes * i.num_servers} `primerl inference` "
                        f"servers on {cfg.deployment.inference_nodes} inference node(s) behind vllm-router")
            via = (f"{p.broadcast_backend} broadcast from trainer rank 0 (its node, port "
                   f"{i.broadcast_port}) to every server" if p.weight_update == "broadcast" and not i.pd.enabled
                   else "files in output_dir/transport, loaded by each server")
            return f"{head}, {dtype}; weights by {via}"
        where = "the CPU" if p.engine_gpu is None else f"cuda:{p.engine_gpu}"
        kv = f"KV cache <= {cfg.inference.kv_cache_gb:g} GB" if cfg.inference.kv_cache_gb else "KV cache uncapped"
        share = " (shared with the trainer, which takes the memory the engine leaves)" if p.shared else ""
        at = "the orchestrator's node" if get_launcher(cfg).capabilities.spans_nodes else "127.0.0.1"
        via = (f"{p.broadcast_backend} broadcast from trainer rank 0 (group at {at}:{cfg.inference.broadcast_port})"
               if p.weight_update == "broadcast" else "files in output_dir/transport")
        return (f"# inference: embedded engine on {where}{share}, {kv}, "
                f"{p.dtype}; weights by {via}")

    def inference_plan(self, cfg, model, layout, device_memory):
        from ..memory_plan import inference_plan

        return inference_plan(model, weight_bytes=layout.act_bytes, kv_bytes=layout.act_bytes,
                              device_memory=device_memory)

    # ------------------------------------------------------------------ orchestrator side
    def make_client(self, cfg, vocab_size, *, pool=None):
        from ..orchestrator.clients import make_embedded_client, server_client

        client = server_client(cfg, vocab_size, pool, pool_routing=False, pd_routing=cfg.inference.capture_routing)
        return client if client is not None else make_embedded_client(cfg, vocab_size)

    def make_teacher_client(self, cfg, path, *, name="teacher"):
        """``distill.url``: ``primerl inference --role teacher`` there (``POST /v1/score``)."""
        if not cfg.distill.url:
            return super().make_teacher_client(cfg, path, name=name)
        from .teacher_clients import ServerTeacher

        return ServerTeacher(cfg.distill.url, temperature=cfg.inference.temperature,
                             timeout_s=cfg.distill.timeout_s, name=name)

    def pd_commands(self, cfg):
        from .pd_launch import embedded_pd_commands

        return embedded_pd_commands(cfg)

    def weight_receiver(self, cfg, client, transport):
        from ..orchestrator.orchestrator import EmbeddedClient
        from .weight_sync import FileWeightVersions

        if isinstance(client, EmbeddedClient) and client.receiver is not None:
            return client.receiver  # the engine's broadcast receiver, started with the client
        if serves_from_pool(cfg) and _broadcast(cfg):
            from .weight_sync import ServerWeightVersions

            return ServerWeightVersions(client)  # the versions the pool's servers hold (no file shared)
        return FileWeightVersions(transport)

    def generate_server(self, cfg, client, *, policy_version, model_name) -> GenerateServer:
        from .server import EngineServer

        return GenerateServer(EngineServer(client.engine, request_timeout=cfg.inference.timeout_s,
                                           model_name=model_name), client.engine)

    # ------------------------------------------------------------------ trainer side
    def weight_channel(self, cfg, *, model, transport, rank):
        from ..placement import resolve_placement
        from .weight_channels import BucketedBroadcast, FileChannel

        placement = resolve_placement(cfg)
        if cfg.trainer.lora.rank:  # adapter-only updates (the engine applies them: engine.load_weights)
            from ..policy import base_model_name
            from .weight_channels import LoRAChannel

            return LoRAChannel(transport, rank=rank, base_model_name_or_path=base_model_name(cfg))
        if placement.weight_update != "broadcast":
            return FileChannel(transport, rank=rank)
        w = cfg.inference.weight_transfer
        if serves_from_pool(cfg):  # rank 0 gathers, and sends each bucket to every server over a pair of its own
            return BucketedBroadcast(None, transport if rank == 0 else None, rank=rank, dtype=placement.param_dtype,
                                     bucket_bytes=w.bucket_bytes, fp8=w.dtype == "fp8", delta=w.delta,
                                     full_every=w.full_every, sharded=False, peer="the inference pool's servers",
                                     sender=_pool_sender(cfg, placement) if rank == 0 else None)
        sources = cfg.num_trainer_ranks if w.sharded else 1

        def join(source: int):
            from .weight_sync import WeightSyncError, engine_broadcast_host
            from .weight_transfer import join_transfer_groups

            host, port = engine_broadcast_host(), cfg.inference.broadcast_port
            try:
                return join_transfer_groups(host, port, sources=sources, receivers=1, source=source, store_master=False,
                                            timeout_s=cfg.orchestrator.weights_timeout_s,
                                            backend=placement.broadcast_backend)[source]
            except Exception as e:  # noqa: BLE001 (the store raises a bare RuntimeError/DistNetworkError on timeout)
                raise WeightSyncError(f"weight transfer group at {host}:{port}: {_orchestrator()} "
                                      f"did not join within {cfg.orchestrator.weights_timeout_s} s ({e})") from e

        return BucketedBroadcast(join, transport if rank == 0 else None, rank=rank, dtype=placement.param_dtype,
                                 bucket_bytes=w.bucket_bytes, fp8=w.dtype == "fp8", delta=w.delta,
                                 full_every=w.full_every, sharded=w.sharded, peer=_orchestrator())


def _orchestrator() -> str:
    import os

    from ..transport import ORCHESTRATOR_NODE_ENV

    return f"{os.environ.get(ORCHESTRATOR_NODE_ENV) or 'the orchestrator'} (embedded engine's receiver)"


register_backend("embedded", EmbeddedBackend())


def _broadcast(cfg) -> bool:
    from ..placement import resolve_placement

    return resolve_placement(cfg).weight_update == "broadcast"


def _pool_sender(cfg, placement):
    """Trainer rank 0's sender to every server of the pool (``pool_broadcast``): the servers' URLs
    from ``PRIMERL_INFERENCE_POOL`` (set by the launcher, or by ``primerl node`` from the plan),
    the group at this node's address and ``inference.broadcast_port``."""
    import json
    import os

    from ..transport import INFERENCE_POOL_ENV
    from .pool_broadcast import PoolBroadcastSender, trainer_host

    def servers() -> list[str]:
        raw = os.environ.get(INFERENCE_POOL_ENV)
        if not raw:
            raise RuntimeError(f"weights by broadcast to the inference pool: {INFERENCE_POOL_ENV} is not set (the "
                               "pool's servers are named by `primerl rl` / `primerl node`)")
        return list(json.loads(raw)["servers"])

    w = cfg.inference.weight_transfer
    return PoolBroadcastSender(servers, trainer_host(), cfg.inference.broadcast_port,
                               timeout_s=cfg.orchestrator.weights_timeout_s, backend=placement.broadcast_backend,
                               health_timeout_s=cfg.inference.health_timeout_s, bucket_bytes=w.bucket_bytes,
                               delta=w.delta, full_every=w.full_every)
