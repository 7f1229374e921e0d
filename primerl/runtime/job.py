"""Process entry points (``primerl trainer``, ``primerl orchestrator``) and ``run_threads``, the
whole job in one process.

Starting processes lives in ``primerl.runtime.launch``: one machine (``launch.machine``:
``run_rl``, re-exported here), nodes by hand or any scheduler (``launch.node``), 127.x nodes on
this machine (``launch.local``) and SLURM (``launch.slurm``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .trainer.vf_warmstart import job_warm_start
from .config import RLConfig
from .launch.machine import (JobFailed, _spawn, _stop, _tail, first_failure, launched_vllm,  # noqa: F401 (re-exported)
                             prepare_output, run_rl, start_step)
from .lifetime import pid_alive, setup_logging, watch_launcher  # noqa: F401 (setup_logging re-exported)
from .metrics import read_metrics
from .output_dir import claim_output_dir
from .placement import resolve_placement
from .transport import make_transport
from .inference.weight_sync import network_weight_source

log = logging.getLogger("primerl")


def _pid_alive(pid: int | None):
    return (lambda: pid_alive(pid)) if pid else None


# ------------------------------------------------------------------------------------ processes
def trainer_main(cfg: RLConfig) -> None:
    from primerl.rl.envs import load_environment

    from .trainer.trainer import run_trainer

    setup_logging("trainer")
    watch_launcher()
    torch.set_num_threads(cfg.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    placement = resolve_placement(cfg)
    if placement.device == "cuda":  # before the process group: NCCL binds this rank to its GPU
        torch.cuda.set_device(placement.trainer_device(int(os.environ.get("LOCAL_RANK", "0"))))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(placement.dist_backend)
    try:
        env = load_environment(cfg.env.id, **cfg.env.args)
        run_trainer(cfg, env.vocab_size, orchestrator_alive=_pid_alive(int(os.environ.get("PRIMERL_PEER_PID", "0"))))
        if torch.distributed.is_initialized():
            # every rank done with its last collective before any tears the group down: a rank that
            # destroyed it while another was still in its final save aborted once at exit (-6)
            torch.distributed.barrier()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def make_pool_client(cfg: RLConfig, vocab_size: int, endpoints: dict):
    """The client of a server pool (``inference.num_servers`` > 1 or ``inference.vllm.urls``):
    ``endpoints`` is ``launch.servers.ServerPool.endpoints()`` (servers, router, processes.json)."""
    from .inference.pool_client import PoolClient
    from .policy import model_config

    mc = model_config(cfg, vocab_size)
    i = cfg.inference
    # a step's requests in flight at once (up to 256 threads): 64 left the servers' batches a quarter
    # full on the main example (2 servers: 1.82 s/step at 64, 1.25 s at 256, bench/RESULTS.md, issue 33)
    expect = False
    if i.backend == "vllm":
        from .inference.vllm_launch import wants_routing

        expect = wants_routing(cfg)
    client = PoolClient(i.vllm, endpoints["servers"], endpoints["router"], timeout_s=i.timeout_s,
                        output_dir=cfg.output_dir, processes_json=endpoints.get("processes"),
                        health_timeout_s=i.health_timeout_s, num_layers=len(mc.moe_layer_ids), top_k=mc.top_k,
                        expect_routing=expect, concurrency=min(256, max(64, cfg.orchestrator.batch_size * cfg.orchestrator.group_size)))
    client.wait_healthy(cfg.inference.vllm.launch_timeout_s)
    return client


def make_client(cfg: RLConfig, vocab_size: int, pool: dict | None = None):
    from .orchestrator.orchestrator import EmbeddedClient

    if cfg.inference.pd.enabled:
        return make_pd_client(cfg, vocab_size)
    if pool is None and os.environ.get("PRIMERL_INFERENCE_POOL"):  # launch.servers.POOL_ENV, set by the launcher
        import json

        pool = json.loads(os.environ["PRIMERL_INFERENCE_POOL"])
    if pool is not None:
        return make_pool_client(cfg, vocab_size, pool)
    if cfg.inference.num_servers > 1 or cfg.inference.vllm.urls:
        raise RuntimeError("inference.num_servers > 1 / inference.vllm.urls: the server pool is started by "
                           "`primerl rl` (launch.servers.ServerPool); this process was started without it")
    if cfg.inference.backend == "vllm":
        from .policy import model_config
        from .inference.vllm_client import VLLMClient
        from .inference.vllm_launch import wants_routing

        mc = model_config(cfg, vocab_size)  # to check routed experts [N, L, k]
        return VLLMClient(cfg.inference.vllm, timeout_s=cfg.inference.timeout_s, output_dir=cfg.output_dir,
                          num_layers=len(mc.moe_layer_ids), top_k=mc.top_k, expect_routing=wants_routing(cfg))
    from .inference.engine import InferenceEngine
    from .policy import build_model

    i = cfg.inference
    placement = resolve_placement(cfg)
    device = placement.engine_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(cfg, vocab_size, device=device, dtype=placement.param_dtype)
    engine = InferenceEngine(model, max_batch_size=i.max_batch_size, kv_cache=i.kv_cache,
                             capture_routing=i.capture_routing, fp8_experts=i.fp8_experts,
                             router_noise=i.router_noise, noise_seed=cfg.seed, kv_cache_gb=i.kv_cache_gb)
    log.info("embedded engine on %s in %s; weights by %s", device, placement.param_dtype, placement.weight_update)
    receiver = None
    if placement.weight_update == "broadcast":
        from .inference.weight_sync import EngineWeightReceiver, engine_broadcast_host

        receiver = EngineWeightReceiver(engine_broadcast_host(), i.broadcast_port, backend=placement.broadcast_backend,
                                        device=device, timeout_s=cfg.orchestrator.weights_timeout_s).start()
    return EmbeddedClient(engine, timeout_s=i.timeout_s, receiver=receiver)


def make_pd_client(cfg: RLConfig, vocab_size: int):
    """``inference.pd``: start the prefill and decode servers and vllm-router in P/D mode
    (``inference.pd_launch``), and the client that samples through the router; the deployment
    stops with this process (``client.deployment.stop()`` at exit)."""
    import atexit
    import dataclasses

    from .inference.pd_client import PDClient
    from .inference.pd_launch import PDDeployment
    from .inference.vllm_launch import wants_routing
    from .policy import model_config

    dep = PDDeployment(cfg).start()
    atexit.register(dep.stop)
    mc = model_config(cfg, vocab_size)
    routing = wants_routing(cfg) if cfg.inference.backend == "vllm" else cfg.inference.capture_routing
    v = dataclasses.replace(cfg.inference.vllm, url=dep.router_url)
    client = PDClient(v, dep.server_urls, resamples=cfg.inference.pd.resamples, timeout_s=cfg.inference.timeout_s,
                      output_dir=cfg.output_dir, num_layers=len(mc.moe_layer_ids), top_k=mc.top_k,
                      expect_routing=routing)
    client.deployment = dep
    return client


def orchestrator_main(cfg: RLConfig) -> None:
    from primerl.rl.envs import load_environment

    from .orchestrator.vf_orchestrator import build_orchestrator  # the built-in Orchestrator, or the verifiers path
    from .policy import model_config

    setup_logging("orchestrator")
    watch_launcher()
    torch.set_num_threads(cfg.threads)
    env = load_environment(cfg.env.id, **cfg.env.args)
    start = start_step(cfg)
    transport = make_transport(cfg, Path(cfg.output_dir) / "transport", "orchestrator")
    transport.drop_batches_from(start)
    client = make_client(cfg, env.vocab_size)

    def on_batch(step, m):
        log.info("batch %d written: reward %.3f off_policy<=%d version %d %.0f tok/s", step, m["reward/mean"],
                 m["off_policy/max"], m["policy_version"], m["inference/tokens_per_s"])

    receiver = getattr(client, "receiver", None)
    transport.weight_source = network_weight_source(cfg, client)  # broadcast: versions not from files
    try:
        orch = build_orchestrator(cfg, env, client, transport, start_step=start,
                            trainer_alive=_pid_alive(int(os.environ.get("PRIMERL_PEER_PID", "0"))),
                            top_k=model_config(cfg, env.vocab_size).top_k)
        if cfg.orchestrator.metrics_port:
            from .orchestrator.monitor import OrchestratorMonitor

            orch.monitor = OrchestratorMonitor(cfg.orchestrator.metrics_host, cfg.orchestrator.metrics_port).start()
        orch.run(on_batch=on_batch)
        transport.wait_taken(cfg.trainer.batch_timeout_s)  # zmq: no batch left in a socket at exit
        if receiver is not None:  # until the trainer's end-of-updates message (weight_sync.EngineWeightReceiver.close)
            receiver.close()
    except BaseException:
        _exit_past_receiver(receiver)
        raise


def _exit_past_receiver(receiver) -> None:
    """A failed orchestrator whose weight receiver still waits in a collective: exit at once with
    the traceback logged (rc 1); a normal exit would abort (-6) on the receiver's live thread."""
    if receiver is not None and receiver.alive:
        log.exception("the orchestrator failed (its weight receiver is still in the trainer's group)")
        logging.shutdown()
        os._exit(1)


# ------------------------------------------------------------------------------------ launcher
def run_threads(cfg: RLConfig, *, quiet: bool = True, parts: dict | None = None) -> list[dict]:
    """The same job in ONE process: trainer in a thread, orchestrator + engine in this one.

    For tests, notebooks and experiments; each side still talks only through the transport.
    Holds ``output_dir``'s lock for the job's life, as ``run_rl`` does. ``parts``, when given,
    receives the job's ``"client"`` (with the engine) and, at the end, its ``"trainer"``.
    """
    with claim_output_dir(cfg):
        cfg = job_warm_start(cfg, quiet=quiet)
        with launched_vllm(cfg):
            return _run_threads(cfg, quiet=quiet, parts={} if parts is None else parts)


def _run_threads(cfg: RLConfig, *, quiet: bool, parts: dict) -> list[dict]:
    import threading

    from primerl.rl.envs import load_environment

    from .orchestrator.vf_orchestrator import build_orchestrator  # the built-in Orchestrator, or the verifiers path
    from .policy import model_config
    from .trainer.trainer import run_trainer

    out = Path(cfg.output_dir)
    start = prepare_output(cfg)
    env = load_environment(cfg.env.id, **cfg.env.args)
    errors: list[BaseException] = []
    done = threading.Event()

    def trainer_thread():
        try:
            parts["trainer"] = run_trainer(cfg, env.vocab_size, orchestrator_alive=lambda: not errors)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            done.set()

    cfg.log.progress = cfg.log.progress and not quiet
    th = threading.Thread(target=trainer_thread, name="trainer", daemon=True)
    th.start()
    transport = make_transport(cfg, out / "transport", "orchestrator")
    client = parts["client"] = make_client(cfg, env.vocab_size)
    transport.weight_source = getattr(client, "receiver", None)
    orch = build_orchestrator(cfg, env, client, transport, start_step=start,
                        trainer_alive=lambda: not done.is_set() or not errors, top_k=model_config(cfg, env.vocab_size).top_k)
    try:
        orch.run()
    except BaseException:
        getattr(transport, "close", lambda: None)()  # the ZeroMQ batch server's port
        if errors:
            raise errors[0]
        raise
    th.join(timeout=cfg.trainer.batch_timeout_s + 60)
    getattr(transport, "close", lambda: None)()
    if errors:
        raise errors[0]
    receiver = getattr(client, "receiver", None)
    if receiver is not None:  # the trainer said goodbye: let the receiving thread leave its group
        receiver.close(timeout=30)
    return read_metrics(out / "metrics.jsonl")
