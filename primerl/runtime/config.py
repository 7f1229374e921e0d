"""Typed configuration of an RL job: dataclasses loaded from TOML plus ``--key.sub value`` overrides.

Every section is a dataclass; unknown keys (in the file or on the command line) raise
``ConfigError`` naming the full dotted key, and ``validate`` checks ranges, names and the trainer
layout before any work. This module imports nothing from the runtime (placement, policy, launch
import it): the job's full check, which adds the node plan, the policy's random init, the job's
combinations and the device placement, is ``primerl.runtime.validate`` (its ``load_config`` is
what ``primerl rl`` and the tests call).

>>> cfg = load_config("examples/reverse_text.toml", ["--trainer.lr", "1e-3"], check=False)
>>> print(to_toml(cfg))   # the resolved config, what ``primerl rl --dry-run`` prints
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad configuration value or key; the message names the dotted key."""


@dataclass
class ModelConfig:
    """The policy: a local Hugging Face directory, or a random init from these fields (names as in
    ``primerl.models.MoETransformerConfig``; ``extra`` passes any other field of it)."""

    path: str = ""
    family: str = "qwen3_moe"
    vocab_size: int = 0  # 0: the environment's vocab_size
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    moe_dim: int = 64
    num_experts: int = 4
    top_k: int = 2
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0  # rotary base; short sequences want a small one (see examples/reverse_text.toml)
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)


@dataclass
class EnvConfig:
    id: str = "reverse-text"  # a built-in name or "package.module:ClassOrFactory"
    args: dict = field(default_factory=dict)
    timeout_s: float = 30.0  # per reward / env-turn call
    max_retries: int = 2  # an episode whose env call raises is resampled this many times, then fails
    max_concurrent_calls: int = 64  # env calls (reward / respond) running at once, each on its own thread
    max_abs_reward: float = 1e6  # larger |reward| is clipped to +-this (counted: rewards/clipped)


@dataclass
class VLLMConfig:
    url: str = "http://127.0.0.1:8000"
    model: str = ""  # served model name / path
    launch: bool = False  # start the vLLM server from this job (serving model.path or the seeded init)
    python: str = ""  # interpreter with vLLM installed, run as `-m vllm.entrypoints.openai.api_server` ("": this one)
    launch_timeout_s: float = 900.0  # until the launched server answers /health
    cpu_kv_cache_gb: float = 1.0  # VLLM_CPU_KVCACHE_SPACE of a launched vLLM CPU build (GPU builds ignore it)
    host: str = "127.0.0.1"
    port: int = 8000
    data_parallel: int = 1
    tensor_parallel: int = 1
    expert_parallel: bool = False
    fp8: bool = False
    all2all_backend: str = ""  # "", "deepep_high_throughput", "deepep_low_latency", "pplx", "naive"
    disaggregation: str = ""  # "", "prefill" or "decode" (a P/D-disaggregated role)
    kv_connector: str = "NixlConnector"
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 0
    enable_return_routed_experts: bool = True  # with inference.capture_routing; vLLM captures on GPU only
    weight_update: str = "filesystem"  # "filesystem" (safetensors + marker) or "broadcast" (torch.distributed)
    update_fp8: bool = False  # expert weights sent as block-FP8 + *_scale_inv (for a block-FP8 served checkpoint)
    # broadcast: trainer rank 0 is rank 0 of a group with the receivers (vLLM workers) after it
    broadcast_host: str = "127.0.0.1"
    broadcast_port: int = 29600
    broadcast_receivers: int = 0  # receiver processes; 0: data_parallel * tensor_parallel
    broadcast_rpc: bool = True  # ask the server (collective_rpc) to receive; False: receivers listen on their own
    broadcast_timeout_s: float = 300.0  # joining the group, and each version's transfer
    extra_args: list = field(default_factory=list)
    # several external vLLM servers: the job puts a vllm-router in front of them (url is then unused)
    urls: list = field(default_factory=list)


@dataclass
class PDConfig:
    """Prefill/decode disaggregation (issue 35): ``prefill`` prefill servers and ``decode`` decode
    servers behind vllm-router in P/D mode, started by the job (both 0: off)."""

    prefill: int = 0
    decode: int = 0
    host: str = "127.0.0.1"
    base_port: int = 8100  # prefill servers on base_port, base_port + 1, ...; the decode servers after them
    router_port: int = 8090
    router_metrics_port: int = 8091  # the router's Prometheus exporter (its default, 29000, is shared by every router)
    router: str = ""  # the vllm-router executable ("": the one next to this Python)
    policy: str = "round_robin"  # the router's policy for both pools
    resamples: int = 3  # a request whose KV hand-off fails is sent again this many times (counted)
    launch_timeout_s: float = 300.0

    @property
    def enabled(self) -> bool:
        return self.prefill > 0 or self.decode > 0


@dataclass
class InferenceConfig:
    backend: str = "embedded"  # "embedded" (this process, CPU or one GPU) or "vllm"
    # GPUs of the engine (device = cuda). []: with one GPU the engine shares it with the trainer,
    # with two or more it takes GPU 0 and the trainer ranks the next ones. The embedded engine uses one.
    gpu_ids: list = field(default_factory=list)
    kv_cache_gb: float = 0.0  # the embedded engine's KV-cache budget (0: grows as requests need, no cap)
    # embedded engine: "auto" (broadcast when the engine has its own GPU, else filesystem),
    # "filesystem" (safetensors through output_dir) or "broadcast" (torch.distributed from trainer rank 0:
    # NCCL between GPUs, gloo on CPU); vLLM has its own inference.vllm.weight_update
    weight_update: str = "auto"
    broadcast_port: int = 29610  # the embedded engine's broadcast group (on 127.0.0.1)
    temperature: float = 1.0
    top_p: float = 1.0
    max_batch_size: int = 256  # sequences decoded together (continuous batching slots)
    kv_cache: bool = True  # False: recompute the whole prefix every token (the reference path)
    fp8_experts: bool = False  # expert weights rounded through FP8 (re-quantized at every update)
    capture_routing: bool = True
    router_noise: float = 0.0  # std of noise on the sampler's router logits (a numerics stand-in)
    timeout_s: float = 300.0  # one generation batch
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    pd: PDConfig = field(default_factory=PDConfig)
    # > 1: that many `primerl inference` server processes (each its own engine) behind vllm-router;
    # 1: the engine inside the orchestrator (launch.servers, inference.pool_client)
    num_servers: int = 1
    router_policy: str = "consistent_hash"  # vllm-router policy (X-Session-ID for consistent_hash) or round_robin, ...
    max_restarts: int = 3  # per server (and the router): past it the job fails naming the process
    health_timeout_s: float = 10.0  # a server that misses /health twice within this is hung: killed, restarted


@dataclass
class OrchestratorConfig:
    batch_size: int = 32  # prompts per step
    group_size: int = 8  # rollouts per prompt
    max_async_level: int = 1  # policy versions between the sampler and the trainer (0 = synchronous)
    max_off_policy_steps: int = 4  # samples older than this are discarded and counted
    advantage: str = "drgrpo"  # grpo, drgrpo, rloo, rloo_std (/ std of the step's rewards) or max_rl
    seq_len: int = 2048  # tokens per packed micro-batch
    weights_timeout_s: float = 300.0
    # rollout batches to the trainer ranks: "filesystem" (files under output_dir/transport) or "zmq"
    # (TCP, ZeroMQ ROUTER/DEALER: no filesystem shared between orchestrator and trainer nodes)
    batch_transport: str = "filesystem"
    zmq_host: str = ""  # where trainer ranks reach the orchestrator; "": its node in the plan (127.0.0.1 locally)
    zmq_port: int = 29620
    metrics_port: int = 0  # > 0: serve GET /metrics (Prometheus) and /health on this port; 0: off
    metrics_host: str = "127.0.0.1"
    save_samples: bool = False  # write each step's trained samples to <output_dir>/samples/step_N.jsonl


@dataclass
class LossConfig:
    """``primerl.rl.losses.policy_loss`` as the trainer runs it; the default is prime-rl's
    (DPPO-TV, delta 0.2/0.2, KL 1e-3, zero-advantage tokens out of the loss)."""

    method: str = "dppo_tv"  # a name in primerl.rl.losses.LOSS_METHODS, or "package.module:function"
    aggregation: str = "token_mean"
    corrections: list = field(default_factory=list)
    hparams: dict = field(default_factory=dict)  # e.g. {delta_low = 0.2, delta_high = 0.2, kl_coef = 1e-3}
    drop_zero_advantage: bool = True  # tokens with advantage 0 leave the loss and its denominator
    ref_kl_coef: float = 0.0  # > 0: KL-to-reference term against a frozen copy of the initial policy
    sft_coef: float = 0.0  # > 0: cross-entropy on the loss tokens, normalised on its own tokens


@dataclass
class ParallelConfig:
    """The trainer's layout over ``num_trainer_ranks`` (``primerl.parallel.ParallelDims``):
    ``dp_replicate * dp_shard * cp`` ranks; ``ep`` borrows from ``dp_shard * cp``."""

    dp_replicate: int = 1  # HSDP replicas (gradients all-reduced between them)
    dp_shard: int = -1  # FSDP shards; -1: the ranks that dp_replicate and cp leave
    cp: int = 1  # context parallel: each packed micro-batch split over cp ranks (ring attention)
    ep: int = 1  # expert parallel: experts split over ep ranks (token all-to-all)
    activation_checkpointing: str = "none"  # "none", "full" (every block) or "selective" (every 2nd block)
    fp8: str = "off"  # "off", "blockwise", "blockwise_fp8_wgrad" or "rowwise" (primerl.kernels.fp8_training recipes)
    cp_layout: str = "zigzag"  # "zigzag" (causal load balance) or "contiguous"
    cp_kind: str = "ring"  # "ring", "ulysses" (head all-to-all) or "ulysses_ring" (2-D: cp = cp_ulysses x ring)
    cp_ulysses: int = 0  # Ulysses degree; 0: cp for "ulysses", 1 for "ring"; required for "ulysses_ring"
    activation_offload: bool = False  # checkpointed blocks' saved activations kept in host memory
    cpu_offload: bool = False  # parameters, gradients and optimizer state on the host (FSDP2 CPUOffloadPolicy)


@dataclass
class TrainerConfig:
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8  # AdamW's epsilon
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lr_schedule: str = "constant"  # "constant", "linear" or "cosine" (after warmup)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    router_replay: bool = True
    # "auto" (bf16 on CUDA with model.dtype = float32, else off), "bf16" (bf16 compute, float32 master
    # weights and optimizer state, gradients reduced in float32: FSDP2 MixedPrecisionPolicy) or "off"
    mixed_precision: str = "auto"
    mini_batches: int = 1  # optimizer steps per rollout batch (each on a slice of its micro-batches)
    fsdp: bool = True  # with several ranks: FSDP2 from primerl.parallel (False: replicated weights + all-reduce)
    attention: str = "auto"  # "kernel" (the model's varlen kernel), "padded" (dense SDPA) or "auto" (padded on CPU)
    entropy_coef: float = 0.0  # minus this times the token-mean entropy is added to the loss
    entropy_decay_steps: int = 0  # > 0: the coefficient falls linearly to 0 at this step
    loss: LossConfig = field(default_factory=LossConfig)
    batch_timeout_s: float = 300.0
    nan_retries: int = 2  # a step with a non-finite loss is skipped (counted) this many times in a row
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Run the model's forward (and so its backward) under torch.compile(dynamic=True): one graph
    # serves every packing. Off by default until measured on a GPU (bench/RESULTS.md: CPU step time).
    compile: bool = False


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N steps (0: only at the end)
    keep: int = 2
    resume: bool = False  # continue from the latest checkpoint in output_dir
    async_save: bool = False  # write interval checkpoints in a background thread (DCP async_save)


@dataclass
class WarmStartConfig:
    """A supervised warm start that the job runs before RL (``primerl.runtime.trainer.vf_warmstart``):
    the random-init policy of ``[model]`` is trained on the environment's task demonstrations
    (``Task.demonstration()``, e.g. the ``primerl-vault`` tool-use task) for ``steps`` steps, written to
    ``<output_dir>/warm_start`` and RL starts from it (``model.path`` of the resolved config)."""

    steps: int = 0  # 0: no warm start
    batch_size: int = 16  # demonstrations per step
    lr: float = 3e-3


@dataclass
class LogConfig:
    progress: bool = True
    plot: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "primerl"


@dataclass
class DeploymentConfig:
    """Where the job's processes run (``primerl.runtime.launch``): one machine (``"local"``, the
    default), nodes started by hand or any scheduler with ``primerl node`` (``"nodes"``), or a SLURM
    batch job (``"slurm"``). Trainer nodes run torchrun with c10d rendezvous at ``rdzv_endpoint``."""

    kind: str = "local"  # "local", "nodes" or "slurm"
    trainer_nodes: int = 1  # nodes running trainer ranks (torchrun --nnodes)
    inference_nodes: int = 0  # nodes running inference servers (vLLM); 0: the engine is in the orchestrator
    orchestrator: str = "trainer"  # "trainer": beside the trainer on trainer node 0; "own": a node of its own
    ranks_per_node: int = 0  # trainer ranks per trainer node; 0: num_trainer_ranks / trainer_nodes
    gpus_per_node: int = 0  # GPUs of each node; 0: CPU nodes (trainer ranks are processes)
    hosts: list = field(default_factory=list)  # "nodes": trainer hosts, then inference, then the orchestrator's own
    rdzv_endpoint: str = ""  # "host:port" of the c10d rendezvous; "": the first trainer host, port 29400
    rdzv_timeout_s: float = 60.0  # a node that cannot join the rendezvous fails after this
    grace_s: float = 30.0  # when one node fails, the others get this long to stop (checkpoints finish)
    sbatch_template: str = ""  # a Jinja2 sbatch template; "": primerl/runtime/launch/templates/sbatch.sh.j2
    sbatch_args: list = field(default_factory=list)  # extra #SBATCH options, e.g. ["--partition=gpu", "--time=4:00:00"]


@dataclass
class RLConfig:
    output_dir: str = "outputs/run"
    overwrite: bool = False  # a non-empty output_dir is refused unless this or checkpoint.resume is true
    seed: int = 0
    max_steps: int = 50
    device: str = "auto"  # "auto" (cuda when torch sees a GPU), "cpu" or "cuda": where trainer and engine run
    threads: int = 1  # torch threads per process
    num_trainer_ranks: int = 1  # torchrun processes of the trainer (gloo on CPU, nccl on GPUs)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    log: LogConfig = field(default_factory=LogConfig)
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)


# --------------------------------------------------------------------------------------------
# building from dicts, overrides, dumping


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, typ: Any, key: str) -> Any:
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table/section, got {value!r}")
        return from_dict(typ, value, prefix=key + ".")
    origin = typing.get_origin(typ) or typ
    if origin is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}: expected a bool, got {value!r}")
    if origin is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an int, got {value!r}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an int, got {value!r}") from None
    if origin is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if origin is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if origin in (list, dict):
        if isinstance(value, str):  # from the command line: JSON or a TOML inline table / array
            parsed = _parse_scalar(value)
            if parsed is value and origin is list:
                parsed = [v for v in value.split(",") if v]
            value = parsed
        if not isinstance(value, origin):
            hint = {dict: " (a JSON object '{\"k\": 1}' or a TOML inline table '{k = 1}')",
                    list: " (a JSON or TOML array '[1, 2]', or 'a,b')"}[origin]
            raise ConfigError(f"{key}: expected a {origin.__name__}{hint}, got {value!r}")
        return value
    return value


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass ``cls`` from a nested dict; unknown keys raise naming the dotted key."""
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k not in names:
            raise ConfigError(f"unknown config key {prefix}{k!s} (valid keys in "
                              f"{prefix.rstrip('.') or 'the top level'}: {sorted(names)})")
        kwargs[k] = _coerce(v, hints[k], prefix + k)
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def apply_override(cfg, dotted: str, raw: Any) -> None:
    """Set ``cfg.<dotted>`` from a string (or value), coerced to the field's declared type."""
    parts = dotted.split(".")
    obj, path = cfg, []
    for i, name in enumerate(parts):
        path.append(name)
        if not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(obj)}:
            if isinstance(obj, dict):  # a free-form table (env.args, loss.hparams)
                rest = ".".join(parts[i:])
                obj[rest] = _parse_scalar(raw)
                return
            raise ConfigError(f"unknown config key {'.'.join(path)}")
        typ = _hints(type(obj))[name]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(typ):
                raise ConfigError(f"{dotted} is a section; set one of its keys, e.g. --{dotted}.<key>")
            value = raw if typ is str else (_parse_scalar(raw) if typ in (dict, list) or
                                            typing.get_origin(typ) in (dict, list) else raw)
            setattr(obj, name, _coerce(value, typ, dotted))
            return
        obj = getattr(obj, name)


def _parse_scalar(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        if raw.strip()[:1] in ("{", "["):  # the TOML inline syntax the config files use: {delta_low = 0.2}
            try:
                return tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                return raw
        low = raw.lower()
        if low in ("true", "false"):
            return low == "true"
        return raw


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """``["--a.b", "1", "--c=2", "--flag"]`` -> ``[("a.b", "1"), ("c", "2"), ("flag", "true")]``."""
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--") or len(tok) == 2:
            raise ConfigError(f"expected --key.sub value, got {tok!r}")
        key = tok[2:]
        if "=" in key:
            key, _, val = key.partition("=")
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            val = argv[i + 1]
            i += 2
        else:
            val, i = "true", i + 1
        out.append((key.replace("-", "_"), val))
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *, check: bool = True) -> RLConfig:
    """The config of ``path`` with ``overrides``; ``check``: this module's ``validate`` (fields, names,
    trainer layout). The job's full check is ``primerl.runtime.validate.load_config``."""
    data = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
    cfg = from_dict(RLConfig, data)
    file_loss = (cfg.trainer.loss.method, dict(cfg.trainer.loss.hparams))
    pairs = parse_overrides(overrides or [])
    for key, val in pairs:
        apply_override(cfg, key, val)
    _drop_replaced_method_hparams(cfg, *file_loss, [k for k, _ in pairs])
    if check:
        validate(cfg)
    return cfg


def _drop_replaced_method_hparams(cfg: RLConfig, file_method: str, file_hparams: dict, keys: list[str]) -> None:
    """``--trainer.loss.method X`` on the command line replaces the file's method, and with it that
    method's own hyperparameters in the file's ``hparams`` (dppo_tv's delta_low/delta_high under
    ppo_clip are an error, not a setting): those X does not use are dropped, with a warning. Kept:
    names X also uses (kl_coef), those of corrections/terms, and anything set on the command line."""
    import logging

    from primerl.rl.losses import DEFAULT_HPARAMS

    loss = cfg.trainer.loss
    if ("trainer.loss.method" not in keys or "trainer.loss.hparams" in keys or loss.method == file_method
            or file_method not in DEFAULT_HPARAMS):
        return
    new_names = DEFAULT_HPARAMS.get(loss.method, {})
    given = {k.removeprefix("trainer.loss.hparams.") for k in keys if k.startswith("trainer.loss.hparams.")}
    drop = [k for k in file_hparams if k in DEFAULT_HPARAMS[file_method] and k not in new_names and k not in given]
    if drop:
        for k in drop:
            loss.hparams.pop(k, None)
        logging.getLogger("primerl.config").warning(
            "trainer.loss.method = %r (command line) replaces the file's %r: its hyperparameters %s are dropped "
            "(pass --trainer.loss.hparams to set the new method's)", loss.method, file_method, ", ".join(drop))


def _need(cond: bool, key: str, msg: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}, got {value!r}")


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
    _need(o.batch_transport in ("filesystem", "zmq"), "orchestrator.batch_transport", "must be filesystem or zmq",
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


def trainer_ranks_per_node(cfg: RLConfig) -> int:
    """Trainer ranks on one trainer node (``num_trainer_ranks`` on one machine)."""
    d = cfg.deployment
    if d.kind == "local":
        return cfg.num_trainer_ranks
    return d.ranks_per_node or max(cfg.num_trainer_ranks // max(d.trainer_nodes, 1), 1)


FP8_RECIPES = ("blockwise", "blockwise_fp8_wgrad", "rowwise")
_FP8_BLOCK = 128


def parallel_dims(cfg: RLConfig):
    """``primerl.parallel.ParallelDims`` of ``trainer.parallel`` over ``num_trainer_ranks``
    (ConfigError naming the key when the sizes do not fit)."""
    from primerl.parallel.mesh import ParallelDims

    p = cfg.trainer.parallel
    try:
        return ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, ep=p.ep,
                           world_size=cfg.num_trainer_ranks)
    except ValueError as e:
        raise ConfigError(f"trainer.parallel (num_trainer_ranks = {cfg.num_trainer_ranks}): {e}") from None


def _model_dims(cfg: RLConfig) -> dict[str, int]:
    m = cfg.model
    if not m.path:
        return {"num_experts": m.num_experts, "dim": m.dim, "moe_dim": m.moe_dim}
    from primerl.models.config import MoETransformerConfig

    mc = MoETransformerConfig.from_hf(m.path)
    return {"num_experts": mc.num_experts, "dim": mc.dim, "moe_dim": mc.moe_dim}


def _sequence_level_loss(loss: LossConfig) -> str | None:
    """What in the loss needs whole sequences on one rank (None: all terms are per token)."""
    if loss.method in ("gspo", "gspo_token"):
        return f"trainer.loss.method = {loss.method!r}"
    if loss.aggregation == "seq_mean_token_mean":
        return "trainer.loss.aggregation = 'seq_mean_token_mean'"
    for c in ("geo_rs", "veto", "sequence_mask"):
        if c in loss.corrections:
            return f"trainer.loss.corrections contains {c!r}"
    if "mis" in loss.corrections and loss.hparams.get("mis_level") == "sequence":
        return "trainer.loss.hparams.mis_level = 'sequence'"
    return None


CP_KINDS = ("ring", "ulysses", "ulysses_ring")


def cp_degrees(p: ParallelConfig, cp: int) -> tuple[int, int]:
    """``(ulysses, ring)`` degrees of context parallelism ``cp`` for ``trainer.parallel``."""
    if p.cp_kind == "ring":
        u = p.cp_ulysses or 1
    elif p.cp_kind == "ulysses":
        u = p.cp_ulysses or cp
    else:
        u = p.cp_ulysses
    return u, cp // u


def _attention_heads(cfg: RLConfig) -> tuple[int, int]:
    """(query heads, KV heads) of the policy model (MLA: the dense form's per-head K/V, KV = query heads)."""
    m = cfg.model
    if not m.path:
        return m.n_heads, m.n_kv_heads
    from primerl.models.config import MoETransformerConfig

    mc = MoETransformerConfig.from_hf(m.path)
    return mc.n_heads, mc.n_kv_heads


def validate_cp_split(cfg: RLConfig, cp: int) -> None:
    """The context-parallel kind and degrees against cp and the model's heads: a Ulysses degree U
    must divide cp and the query heads; KV heads must divide by U, or U by them (then each KV head
    is replicated U / Hkv times, not an error)."""
    p = cfg.trainer.parallel
    _need(p.cp_kind != "ring" or p.cp_ulysses in (0, 1), "trainer.parallel.cp_ulysses",
          "must be 0 or 1 with cp_kind = 'ring' (use 'ulysses' or 'ulysses_ring' for a Ulysses degree)", p.cp_ulysses)
    _need(p.cp_kind != "ulysses" or p.cp_ulysses in (0, cp), "trainer.parallel.cp_ulysses",
          f"must be 0 or cp = {cp} with cp_kind = 'ulysses' (a Ulysses degree below cp is cp_kind = 'ulysses_ring')",
          p.cp_ulysses)
    if cp == 1 or p.cp_kind == "ring":
        return
    u, ring = cp_degrees(p, cp)
    _need(p.cp_kind != "ulysses_ring" or ring > 1, "trainer.parallel.cp_ulysses",
          f"must be below cp = {cp} with cp_kind = 'ulysses_ring' (ring degree cp / cp_ulysses = {ring}; "
          "use cp_kind = 'ulysses')", p.cp_ulysses)
    heads, kv_heads = _attention_heads(cfg)
    _need(heads % u == 0, "trainer.parallel.cp_ulysses" if p.cp_ulysses else "trainer.parallel.cp",
          f"Ulysses degree {u} must divide the model's {heads} attention heads", p.cp_ulysses or cp)
    _need(kv_heads % u == 0 or u % kv_heads == 0, "trainer.parallel.cp_ulysses" if p.cp_ulysses else "trainer.parallel.cp",
          f"Ulysses degree {u} and the model's {kv_heads} KV heads: one must divide the other (fewer KV heads "
          "are replicated)", p.cp_ulysses or cp)


def validate_parallel(cfg: RLConfig) -> None:
    """``trainer.parallel`` against ``num_trainer_ranks``, the model and the loss."""
    p, t = cfg.trainer.parallel, cfg.trainer
    _need(p.activation_checkpointing in ("none", "full", "selective"), "trainer.parallel.activation_checkpointing",
          "must be none, full or selective", p.activation_checkpointing)
    _need(p.fp8 in ("off",) + FP8_RECIPES, "trainer.parallel.fp8", f"must be 'off' or one of {FP8_RECIPES}", p.fp8)
    _need(p.cp_layout in ("zigzag", "contiguous"), "trainer.parallel.cp_layout", "must be zigzag or contiguous",
          p.cp_layout)
    _need(p.cp_kind in CP_KINDS, "trainer.parallel.cp_kind", f"must be one of {CP_KINDS}", p.cp_kind)
    dims = parallel_dims(cfg)
    _need(p.cp_ulysses >= 0 and (p.cp_ulysses == 0 or dims.cp % p.cp_ulysses == 0), "trainer.parallel.cp_ulysses",
          f"must divide trainer.parallel.cp = {dims.cp} (cp = cp_ulysses x ring degree)", p.cp_ulysses)
    _need(p.cp_kind != "ulysses_ring" or p.cp_ulysses > 1, "trainer.parallel.cp_ulysses",
          "must be set (> 1) with cp_kind = 'ulysses_ring'", p.cp_ulysses)
    validate_cp_split(cfg, dims.cp)
    _need(not p.activation_offload or p.activation_checkpointing != "none", "trainer.parallel.activation_offload",
          "needs trainer.parallel.activation_checkpointing = 'full' or 'selective' (it offloads the checkpointed "
          "blocks' saved inputs)", p.activation_offload)
    _need(not p.cpu_offload or t.fsdp, "trainer.parallel.cpu_offload",
          "needs trainer.fsdp = true (FSDP2's CPUOffloadPolicy)", p.cpu_offload)
    if dims.cp > 1:
        _need(t.attention != "padded", "trainer.attention",
              f"'padded' cannot run with trainer.parallel.cp = {dims.cp} (context parallel needs ring attention; "
              "use 'auto' or 'kernel')", t.attention)
        seq_level = _sequence_level_loss(t.loss)
        _need(seq_level is None, "trainer.parallel.cp",
              f"must be 1 with a sequence-level loss term ({seq_level}): under context parallelism a rank holds "
              "only part of each sequence", dims.cp)
    if not t.fsdp:
        _need(dims.cp == 1 and dims.ep == 1 and dims.dp_replicate == 1, "trainer.fsdp",
              "false (replicated weights) only works without cp, ep and dp_replicate (set trainer.fsdp = true)",
              {"cp": dims.cp, "ep": dims.ep, "dp_replicate": dims.dp_replicate})
    if dims.ep == 1 and p.fp8 == "off":
        return
    md = _model_dims(cfg)
    _need(md["num_experts"] % dims.ep == 0, "trainer.parallel.ep",
          f"must divide the model's num_experts = {md['num_experts']}", dims.ep)
    if p.fp8 != "off":
        bad = {k: md[k] for k in ("dim", "moe_dim") if md[k] % _FP8_BLOCK}
        _need(not bad, "trainer.parallel.fp8",
              f"{p.fp8!r} needs model dims that are multiples of {_FP8_BLOCK} (the FP8 block size) so the experts "
              f"and projections run in FP8; not multiples: {bad}", p.fp8)


def describe_parallel(cfg: RLConfig) -> str:
    """The trainer mesh's named view sizes, as TOML comment lines (``--dry-run`` prints them)."""
    dims = parallel_dims(cfg)
    views = " ".join(f"{k}={v}" for k, v in dims.view_sizes().items())
    p = cfg.trainer.parallel
    return (f"# trainer mesh over {dims.world_size} rank(s): {views}\n"
            f"# each cp rank holds seq_len / cp = {cfg.orchestrator.seq_len / dims.cp:g} tokens of a micro-batch; "
            f"fp8 = {p.fp8}; activation_checkpointing = {p.activation_checkpointing}\n"
            f"{describe_cp(cfg, dims.cp)}")


def describe_cp(cfg: RLConfig, cp: int) -> str:
    """One comment line: the context-parallel kind, its Ulysses x ring degrees and the offloads."""
    p = cfg.trainer.parallel
    if cp == 1:
        kind = "cp = 1 (no context parallelism)"
    else:
        u, ring = cp_degrees(p, cp)
        kind = f"cp = {cp}: cp_kind = {p.cp_kind}, ulysses = {u} x ring = {ring}, layout = {p.cp_layout}"
    return (f"# {kind}; activation_offload = {str(p.activation_offload).lower()}; "
            f"cpu_offload = {str(p.cpu_offload).lower()}\n")


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
    # a random init's fields are checked by the model's own config (shapes, rope_theta, ...):
    # primerl.runtime.validate builds it through policy.model_config


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(cfg) -> str:
    """The resolved config as TOML (loadable again with ``load_config``)."""
    lines: list[str] = []

    def emit(obj, section: str) -> None:
        if section:
            lines.append(f"\n[{section}]")
        subs = []
        for f in dataclasses.fields(obj):
            val = getattr(obj, f.name)
            if dataclasses.is_dataclass(val):
                subs.append((f.name, val))
            else:
                lines.append(f"{f.name} = {_toml_value(val)}")
        for name, val in subs:
            emit(val, f"{section}.{name}" if section else name)

    emit(cfg, "")
    return "\n".join(lines).lstrip("\n") + "\n"
