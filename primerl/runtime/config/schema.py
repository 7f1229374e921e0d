"""The job config's sections as dataclasses, ``ConfigError`` and the ``_need`` check helper."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    # rollout batches to the trainer ranks: "filesystem" (files under output_dir/transport), "zmq"
    # (TCP, ZeroMQ ROUTER/DEALER: no filesystem shared between orchestrator and trainer nodes) or
    # "auto": zmq when the deployment spans nodes (kind nodes / slurm), filesystem on one machine
    batch_transport: str = "auto"
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


def _need(cond: bool, key: str, msg: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}, got {value!r}")


def trainer_ranks_per_node(cfg: RLConfig) -> int:
    """Trainer ranks on one trainer node (``num_trainer_ranks`` on one machine)."""
    d = cfg.deployment
    if d.kind == "local":
        return cfg.num_trainer_ranks
    return d.ranks_per_node or max(cfg.num_trainer_ranks // max(d.trainer_nodes, 1), 1)
