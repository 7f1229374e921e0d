"""``validate``: range and choice checks of every section, names (loss, environment,
model.path), finite numbers; the trainer layout is ``parallel.validate_parallel``."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from .parallel import validate_parallel
from .schema import ConfigError, InferenceConfig, RLConfig, _need


def _validate_pd(i: InferenceConfig) -> None:
    pd = i.pd
    _need(pd.prefill >= 0 and pd.decode >= 0, "inference.pd.prefill/decode", "must be >= 0", (pd.prefill, pd.decode))
    if not pd.enabled:
        return
    _need(pd.prefill >= 1 and pd.decode >= 1, "inference.pd.prefill/decode",
          "need at least one prefill and one decode server (both 0: no disaggregation)", (pd.prefill, pd.decode))
    _need(0 < pd.base_port and pd.base_port + pd.prefill + pd.decode <= 65536, "inference.pd.base_port",
          "must leave a TCP port for every prefill and decode server", pd.base_port)
    _need(0 < pd.router_port < 65536 and not pd.base_port <= pd.router_port < pd.base_port + pd.prefill + pd.decode,
          "inference.pd.router_port", "must be a TCP port outside the servers' range", pd.router_port)
    _need(0 < pd.router_metrics_port < 65536 and pd.router_metrics_port != pd.router_port
          and not pd.base_port <= pd.router_metrics_port < pd.base_port + pd.prefill + pd.decode,
          "inference.pd.router_metrics_port", "must be a free TCP port apart from the router's and the servers'",
          pd.router_metrics_port)
    _need(pd.policy in ("random", "round_robin", "cache_aware", "power_of_two", "consistent_hash"), "inference.pd.policy",
          "must be a vllm-router policy (random, round_robin, cache_aware, power_of_two, consistent_hash)", pd.policy)
    _need(pd.resamples >= 0, "inference.pd.resamples", "must be >= 0", pd.resamples)
    _need(pd.launch_timeout_s > 0, "inference.pd.launch_timeout_s", "must be > 0", pd.launch_timeout_s)
    _need(i.kv_cache, "inference.pd", "needs inference.kv_cache = true (the prefill server hands over its cache)", i.kv_cache)
    _need(not i.vllm.disaggregation, "inference.vllm.disaggregation",
          "is set per server by inference.pd; leave it empty", i.vllm.disaggregation)
    _need(i.num_servers == 1 and not i.vllm.urls, "inference.pd",
          "starts its own prefill and decode servers: leave inference.num_servers = 1 and inference.vllm.urls empty",
          (i.num_servers, i.vllm.urls))


def validate(cfg: RLConfig) -> None:
    """Range and choice checks, names and the trainer layout; raises ``ConfigError`` naming the key.
    ``primerl.runtime.validate.validate`` adds the checks that need the runtime's modules."""
    validate_fields(cfg)
    validate_names(cfg)
    validate_parallel(cfg)


def validate_fields(cfg: RLConfig) -> None:
    """Range and choice checks of every section; raises ``ConfigError`` naming the key."""
    validate_finite(cfg)
    o, i, t, m = cfg.orchestrator, cfg.inference, cfg.trainer, cfg.model
    _need(cfg.max_steps >= 1, "max_steps", "must be >= 1", cfg.max_steps)
    _need(cfg.threads >= 1, "threads", "must be >= 1", cfg.threads)
    _need(cfg.num_trainer_ranks >= 1, "num_trainer_ranks", "must be >= 1", cfg.num_trainer_ranks)
    _need(bool(cfg.output_dir), "output_dir", "must be set", cfg.output_dir)
    _need(o.batch_size >= 1, "orchestrator.batch_size", "must be >= 1", o.batch_size)
    _need(o.group_size >= 2, "orchestrator.group_size", "must be >= 2 (advantages compare samples of a prompt)", o.group_size)
    _need(o.max_async_level >= 0, "orchestrator.max_async_level", "must be >= 0", o.max_async_level)
    _need(o.max_off_policy_steps >= o.max_async_level, "orchestrator.max_off_policy_steps",
          f"must be >= max_async_level ({o.max_async_level})", o.max_off_policy_steps)
    _need(o.advantage in ("grpo", "drgrpo", "rloo", "rloo_std", "max_rl"), "orchestrator.advantage",
          "must be grpo, drgrpo, rloo, rloo_std or max_rl", o.advantage)
    _need(o.seq_len >= 8, "orchestrator.seq_len", "must be >= 8", o.seq_len)
    _need(o.weights_timeout_s > 0, "orchestrator.weights_timeout_s", "must be > 0", o.weights_timeout_s)
    _need(o.batch_transport in ("auto", "filesystem", "zmq"), "orchestrator.batch_transport",
          "must be auto, filesystem or zmq",
          o.batch_transport)
    _need(0 < o.zmq_port < 65536, "orchestrator.zmq_port", "must be a TCP port", o.zmq_port)
    _need(0 <= o.metrics_port <= 65535, "orchestrator.metrics_port", "must be a TCP port (0: off)", o.metrics_port)
    _need(i.backend in ("embedded", "vllm"), "inference.backend", "must be 'embedded' or 'vllm'", i.backend)
    _need(i.temperature > 0, "inference.temperature", "must be > 0", i.temperature)
    _need(0 < i.top_p <= 1, "inference.top_p", "must be in (0, 1]", i.top_p)
    _need(i.max_batch_size >= 1, "inference.max_batch_size", "must be >= 1", i.max_batch_size)
    _need(i.timeout_s > 0, "inference.timeout_s", "must be > 0", i.timeout_s)
    _need(i.router_noise >= 0, "inference.router_noise", "must be >= 0", i.router_noise)
    v = i.vllm
    _need(v.weight_update in ("filesystem", "broadcast"), "inference.vllm.weight_update", "must be filesystem or broadcast", v.weight_update)
    _need(v.weight_update == "filesystem" or i.backend == "vllm", "inference.vllm.weight_update",
          "'broadcast' needs inference.backend = 'vllm' (the embedded engine reads the published files)", v.weight_update)
    _need(v.broadcast_receivers >= 0, "inference.vllm.broadcast_receivers", "must be >= 0", v.broadcast_receivers)
    _need(0 < v.broadcast_port < 65536, "inference.vllm.broadcast_port", "must be a TCP port", v.broadcast_port)
    _need(v.broadcast_timeout_s > 0, "inference.vllm.broadcast_timeout_s", "must be > 0", v.broadcast_timeout_s)
    _need(v.launch_timeout_s > 0, "inference.vllm.launch_timeout_s", "must be > 0", v.launch_timeout_s)
    _need(v.cpu_kv_cache_gb > 0, "inference.vllm.cpu_kv_cache_gb", "must be > 0", v.cpu_kv_cache_gb)
    _need(not v.launch or i.backend == "vllm", "inference.vllm.launch", "needs inference.backend = 'vllm'", v.launch)
    _need(v.disaggregation in ("", "prefill", "decode"), "inference.vllm.disaggregation", "must be '', 'prefill' or 'decode'", v.disaggregation)
    _need(v.all2all_backend in ("", "deepep_high_throughput", "deepep_low_latency", "pplx", "naive", "allgather_reducescatter"),
          "inference.vllm.all2all_backend", "is not a known all-to-all backend", v.all2all_backend)
    _need(v.data_parallel >= 1 and v.tensor_parallel >= 1, "inference.vllm.data_parallel/tensor_parallel", "must be >= 1",
          (v.data_parallel, v.tensor_parallel))
    _validate_pd(i)
    _need(t.lr > 0, "trainer.lr", "must be > 0", t.lr)
    _need(t.eps > 0, "trainer.eps", "must be > 0", t.eps)
    _need(t.max_grad_norm >= 0, "trainer.max_grad_norm", "must be >= 0 (0 disables clipping)", t.max_grad_norm)
    _need(t.lr_schedule in ("constant", "linear", "cosine"), "trainer.lr_schedule", "must be constant, linear or cosine", t.lr_schedule)
    _need(t.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0", t.warmup_steps)
    _need(0 <= t.min_lr_ratio <= 1, "trainer.min_lr_ratio", "must be in [0, 1]", t.min_lr_ratio)
    _need(t.batch_timeout_s > 0, "trainer.batch_timeout_s", "must be > 0", t.batch_timeout_s)
    _need(t.attention in ("auto", "kernel", "padded"), "trainer.attention", "must be auto, kernel or padded", t.attention)
    _need(t.entropy_coef >= 0, "trainer.entropy_coef", "must be >= 0", t.entropy_coef)
    _need(t.entropy_decay_steps >= 0, "trainer.entropy_decay_steps", "must be >= 0", t.entropy_decay_steps)
    _need(t.mini_batches >= 1, "trainer.mini_batches", "must be >= 1", t.mini_batches)
    _need(t.nan_retries >= 0, "trainer.nan_retries", "must be >= 0", t.nan_retries)
    for key in ("ref_kl_coef", "sft_coef"):
        val = getattr(t.loss, key)
        _need(isinstance(val, (int, float)) and 0 <= val < float("inf"), f"trainer.loss.{key}",
              "must be a finite number >= 0", val)
    _need(cfg.checkpoint.interval >= 0, "checkpoint.interval", "must be >= 0", cfg.checkpoint.interval)
    w = cfg.warm_start
    _need(w.steps >= 0, "warm_start.steps", "must be >= 0 (0: no warm start)", w.steps)
    _need(w.batch_size >= 1, "warm_start.batch_size", "must be >= 1", w.batch_size)
    _need(w.lr > 0, "warm_start.lr", "must be > 0", w.lr)
    _need(not (w.steps and m.path), "warm_start.steps",
          f"the warm start trains the random init of [model]; leave model.path empty (it is {m.path!r})", w.steps)
    _need(cfg.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1", cfg.checkpoint.keep)
    _need(m.dtype in ("float32", "bfloat16"), "model.dtype", "must be float32 or bfloat16", m.dtype)
    _need(cfg.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda", cfg.device)
    _need(t.mixed_precision in ("auto", "bf16", "off"), "trainer.mixed_precision", "must be auto, bf16 or off",
          t.mixed_precision)
    _need(t.mixed_precision != "bf16" or m.dtype == "float32", "trainer.mixed_precision",
          "'bf16' keeps float32 master weights: it needs model.dtype = 'float32' (model.dtype = 'bfloat16' "
          "trains in pure bf16; set trainer.mixed_precision = 'off' or 'auto' for that)", t.mixed_precision)
    _need(i.kv_cache_gb >= 0, "inference.kv_cache_gb", "must be >= 0 (0: no cap)", i.kv_cache_gb)
    _need(i.weight_update in ("auto", "filesystem", "broadcast"), "inference.weight_update",
          "must be auto, filesystem or broadcast", i.weight_update)
    _need(i.weight_update != "broadcast" or i.backend == "embedded", "inference.weight_update",
          "'broadcast' is the embedded engine's; vLLM's is inference.vllm.weight_update", i.weight_update)
    _need(0 < i.broadcast_port < 65536, "inference.broadcast_port", "must be a TCP port", i.broadcast_port)
    _need(isinstance(i.num_servers, int) and i.num_servers >= 1, "inference.num_servers", "must be an integer >= 1",
          i.num_servers)
    _need(i.router_policy in ("consistent_hash", "round_robin", "power_of_two", "cache_aware", "random"),
          "inference.router_policy", "must be consistent_hash, round_robin, power_of_two, cache_aware or random",
          i.router_policy)
    _need(i.max_restarts >= 0, "inference.max_restarts", "must be >= 0", i.max_restarts)
    _need(i.health_timeout_s > 0, "inference.health_timeout_s", "must be > 0", i.health_timeout_s)
    _need(i.num_servers == 1 or i.backend == "embedded", "inference.num_servers",
          "> 1 starts `primerl inference` servers (inference.backend = 'embedded'); for several vLLM servers list "
          "them in inference.vllm.urls", i.num_servers)
    _need(not v.urls or i.backend == "vllm", "inference.vllm.urls", "needs inference.backend = 'vllm'", v.urls)
    _need(not v.urls or not v.launch, "inference.vllm.urls", "external servers: inference.vllm.launch must be false",
          v.urls)
    pool = i.num_servers > 1 or bool(v.urls)
    _need(not pool or i.weight_update in ("auto", "filesystem"), "inference.weight_update",
          "a pool of servers takes weights by the filesystem (each server loads the published files)", i.weight_update)
    _need(not pool or v.weight_update == "filesystem", "inference.vllm.weight_update",
          "a pool of servers takes weights by the filesystem", v.weight_update)
    _need(not pool or cfg.deployment.kind == "local", "inference.num_servers",
          "a server pool is started by the one-machine launcher (deployment.kind = 'local')", i.num_servers)
    _need(all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in i.gpu_ids)
          and len(set(i.gpu_ids)) == len(i.gpu_ids), "inference.gpu_ids", "must be distinct GPU indices >= 0", i.gpu_ids)
    _need(m.top_k >= 1 and m.top_k <= m.num_experts, "model.top_k", f"must be in [1, num_experts={m.num_experts}]", m.top_k)
    _need(bool(cfg.env.id), "env.id", "must be set", cfg.env.id)
    _need(cfg.env.timeout_s > 0, "env.timeout_s", "must be > 0", cfg.env.timeout_s)
    _need(cfg.env.max_retries >= 0, "env.max_retries", "must be >= 0", cfg.env.max_retries)
    _need(cfg.env.max_concurrent_calls >= 1, "env.max_concurrent_calls", "must be >= 1", cfg.env.max_concurrent_calls)
    _need(cfg.env.max_abs_reward > 0, "env.max_abs_reward", "must be > 0", cfg.env.max_abs_reward)


# --------------------------------------------------------------------------------------------
# values that would only fail seconds into a run: non-finite numbers, names that resolve nowhere


def validate_finite(cfg) -> None:
    """Every float in the config (free-form tables included) must be finite: ``trainer.lr = inf``
    would turn the weights into NaN at the first update."""

    def walk(v: Any, key: str) -> None:
        if dataclasses.is_dataclass(v):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name), f"{key}.{f.name}" if key else f.name)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{key}.{k}")
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, f"{key}[{i}]")
        elif isinstance(v, float):
            _need(math.isfinite(v), key, "must be a finite number", v)

    walk(cfg, "")


def validate_names(cfg: RLConfig) -> None:
    """Loss method / corrections / aggregation against ``primerl.rl.losses``' lists, the
    environment factory and its arguments, and ``model.path``: resolved now, so ``--dry-run`` fails."""
    from primerl.rl import losses
    from primerl.rl.envs import resolve_environment

    loss = cfg.trainer.loss
    try:
        losses.resolve_method(loss.method)  # a built-in name, or imports 'package.module:function'
    except ValueError as e:
        raise ConfigError(f"trainer.loss.method: {e}") from None
    bad = [c for c in loss.corrections if c not in losses.CORRECTIONS]
    _need(not bad, "trainer.loss.corrections", f"has unknown entries {bad}; choose from {losses.CORRECTIONS}",
          loss.corrections)
    _need(loss.aggregation in losses.AGGREGATIONS, "trainer.loss.aggregation",
          f"must be one of {losses.AGGREGATIONS}", loss.aggregation)
    terms = tuple(n for n, on in (("ref_kl", loss.ref_kl_coef > 0), ("sft", loss.sft_coef > 0)) if on)
    try:  # hyperparameter names and values against the method, corrections and terms in use
        losses.check_loss_spec(loss.method, loss.corrections, loss.aggregation,
                               {k: v for k, v in loss.hparams.items() if k != "norm_constant"}, terms)
    except ValueError as e:
        raise ConfigError(f"trainer.loss.hparams: {e}") from None
    try:
        resolve_environment(cfg.env.id, cfg.env.args)
    except ValueError as e:
        raise ConfigError(f"env.id / env.args: {e}") from None
    m = cfg.model
    if m.path:
        _need(Path(m.path).is_dir(), "model.path", "must be an existing directory (a Hugging Face checkpoint)", m.path)
        _need((Path(m.path) / "config.json").is_file(), "model.path", "has no config.json (not a Hugging Face "
              "checkpoint directory)", m.path)
