"""``[inference]``: the sampler (``InferenceConfig``), its vLLM servers (``[inference.vllm]``,
``VLLMConfig``) and prefill/decode disaggregation (``[inference.pd]``, ``PDConfig``), and the
section's own checks (``check_inference``: ranges, choices and combinations of these keys only).

Checks that compare ``inference.backend`` to a name, or read other sections, are in
``primerl.runtime.validate`` (its docstring is the index of where each key is refused).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import _need

ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "consistent_hash")
# vllm-router 0.1.17 refuses to start under these policies with fewer workers ("Power-of-two policy requires at
# least 2 workers"); the pool's router starts with its initial servers (launch.servers.ROUTER_MIN_WORKERS)
ROUTER_MIN_WORKERS = {"power_of_two": 2}
ALL2ALL_BACKENDS = ("", "deepep_high_throughput", "deepep_low_latency", "pplx", "naive", "allgather_reducescatter")

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


TRANSFER_DTYPES = ("auto", "fp8")


@dataclass
class WeightTransferConfig:
    """``[inference.weight_transfer]`` (issue 42): how a broadcast moves one version (the bucketed
    channel of ``inference.weight_transfer``; files are written as before).

    ``bucket_mb``: tensors are cut into buckets of this size, the next one prepared while the
    previous is on the wire (packed flat with deltas; without, each piece goes as itself).
    ``dtype``: "auto" (the engine's dtype) or "fp8" (block-scaled e4m3, 128x128 blocks, for every
    floating 2-/3-D weight). ``delta``: xor with the previous version + zstd, per bucket, with a
    checksum; a full version every ``full_every`` versions and whenever a receiver is new or its
    checksum disagreed. ``sharded``: every trainer rank sends the shards it owns (false: rank 0
    gathers and sends everything; a pool of servers is always sent to by rank 0)."""

    bucket_mb: float = 64.0
    dtype: str = "auto"
    delta: bool = False
    full_every: int = 10
    sharded: bool = True

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))


def check_weight_transfer(w: WeightTransferConfig) -> None:
    _need(w.bucket_mb > 0, "inference.weight_transfer.bucket_mb", "must be > 0", w.bucket_mb)
    _need(w.dtype in TRANSFER_DTYPES, "inference.weight_transfer.dtype",
          "must be 'auto' (the engine's dtype) or 'fp8'", w.dtype)
    _need(isinstance(w.full_every, int) and not isinstance(w.full_every, bool) and w.full_every >= 1,
          "inference.weight_transfer.full_every", "must be an integer >= 1", w.full_every)


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
    weight_transfer: WeightTransferConfig = field(default_factory=WeightTransferConfig)
    # > 1: that many `primerl inference` server processes (each its own engine) behind vllm-router;
    # 1: the engine inside the orchestrator (launch.servers, inference.pool_client)
    num_servers: int = 1
    router_policy: str = "consistent_hash"  # vllm-router policy (X-Session-ID for consistent_hash) or round_robin, ...
    max_restarts: int = 3  # per server (and the router): past it the job fails naming the process
    health_timeout_s: float = 10.0  # a server that misses /health twice within this is hung: killed, restarted



    @property
    def pool(self) -> bool:
        """Several servers behind a router: ``num_servers > 1`` (ours) or ``vllm.urls`` (external)."""
        return self.num_servers > 1 or bool(self.vllm.urls)


def check_inference(i: InferenceConfig) -> None:
    """``[inference]``, ``[inference.vllm]`` and ``[inference.pd]`` on their own."""
    _need(i.temperature > 0, "inference.temperature", "must be > 0", i.temperature)
    _need(0 < i.top_p <= 1, "inference.top_p", "must be in (0, 1]", i.top_p)
    _need(i.max_batch_size >= 1, "inference.max_batch_size", "must be >= 1", i.max_batch_size)
    _need(i.timeout_s > 0, "inference.timeout_s", "must be > 0", i.timeout_s)
    _need(i.router_noise >= 0, "inference.router_noise", "must be >= 0", i.router_noise)
    _check_vllm(i.vllm)
    _check_pd(i)
    check_weight_transfer(i.weight_transfer)
    _need(i.kv_cache_gb >= 0, "inference.kv_cache_gb", "must be >= 0 (0: no cap)", i.kv_cache_gb)
    _need(i.weight_update in ("auto", "filesystem", "broadcast"), "inference.weight_update",
          "must be auto, filesystem or broadcast", i.weight_update)
    _need(0 < i.broadcast_port < 65536, "inference.broadcast_port", "must be a TCP port", i.broadcast_port)
    _need(isinstance(i.num_servers, int) and i.num_servers >= 1, "inference.num_servers", "must be an integer >= 1",
          i.num_servers)
    _need(i.router_policy in ROUTER_POLICIES, "inference.router_policy",
          "must be consistent_hash, round_robin, power_of_two, cache_aware or random", i.router_policy)
    workers = len(i.vllm.urls) if i.vllm.urls else i.num_servers
    need = ROUTER_MIN_WORKERS.get(i.router_policy, 0)
    _need(not i.pool or workers >= need, "inference.router_policy",
          f"{i.router_policy!r} needs at least {need} servers behind the router (vllm-router refuses to "
          f"start with fewer), inference.num_servers / inference.vllm.urls", workers)
    _need(i.max_restarts >= 0, "inference.max_restarts", "must be >= 0", i.max_restarts)
    _need(i.health_timeout_s > 0, "inference.health_timeout_s", "must be > 0", i.health_timeout_s)
    v = i.vllm
    _need(not v.urls or not v.launch, "inference.vllm.urls", "external servers: inference.vllm.launch must be false",
          v.urls)
    _need(not v.urls or i.weight_update in ("auto", "filesystem"), "inference.weight_update",
          "external servers (inference.vllm.urls) take weights by the filesystem (each loads the published files)",
          i.weight_update)
    _need(not i.pool or v.weight_update == "filesystem", "inference.vllm.weight_update",
          "a pool takes weights by the filesystem (external servers, inference.vllm.urls) or, for primerl's own "
          "servers, by inference.weight_update = 'broadcast'; not by vLLM's broadcast", v.weight_update)
    _need(all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in i.gpu_ids)
          and len(set(i.gpu_ids)) == len(i.gpu_ids), "inference.gpu_ids", "must be distinct GPU indices >= 0",
          i.gpu_ids)


def _check_vllm(v: VLLMConfig) -> None:
    _need(v.weight_update in ("filesystem", "broadcast"), "inference.vllm.weight_update",
          "must be filesystem or broadcast", v.weight_update)
    _need(v.broadcast_receivers >= 0, "inference.vllm.broadcast_receivers", "must be >= 0", v.broadcast_receivers)
    _need(0 < v.broadcast_port < 65536, "inference.vllm.broadcast_port", "must be a TCP port", v.broadcast_port)
    _need(v.broadcast_timeout_s > 0, "inference.vllm.broadcast_timeout_s", "must be > 0", v.broadcast_timeout_s)
    _need(v.launch_timeout_s > 0, "inference.vllm.launch_timeout_s", "must be > 0", v.launch_timeout_s)
    _need(v.cpu_kv_cache_gb > 0, "inference.vllm.cpu_kv_cache_gb", "must be > 0", v.cpu_kv_cache_gb)
    _need(v.disaggregation in ("", "prefill", "decode"), "inference.vllm.disaggregation",
          "must be '', 'prefill' or 'decode'", v.disaggregation)
    _need(v.all2all_backend in ALL2ALL_BACKENDS, "inference.vllm.all2all_backend", "is not a known all-to-all backend",
          v.all2all_backend)
    _need(v.data_parallel >= 1 and v.tensor_parallel >= 1, "inference.vllm.data_parallel/tensor_parallel",
          "must be >= 1", (v.data_parallel, v.tensor_parallel))


def _check_pd(i: InferenceConfig) -> None:
    pd = i.pd
    _need(pd.prefill >= 0 and pd.decode >= 0, "inference.pd.prefill/decode", "must be >= 0", (pd.prefill, pd.decode))
    if not pd.enabled:
        return
    _need(pd.prefill >= 1 and pd.decode >= 1, "inference.pd.prefill/decode",
          "need at least one prefill and one decode server (both 0: no disaggregation)", (pd.prefill, pd.decode))
    servers = range(pd.base_port, pd.base_port + pd.prefill + pd.decode)
    _need(0 < pd.base_port and servers.stop <= 65536, "inference.pd.base_port",
          "must leave a TCP port for every prefill and decode server", pd.base_port)
    _need(0 < pd.router_port < 65536 and pd.router_port not in servers, "inference.pd.router_port",
          "must be a TCP port outside the servers' range", pd.router_port)
    _need(0 < pd.router_metrics_port < 65536 and pd.router_metrics_port != pd.router_port
          and pd.router_metrics_port not in servers, "inference.pd.router_metrics_port",
          "must be a free TCP port apart from the router's and the servers'", pd.router_metrics_port)
    _need(pd.policy in ROUTER_POLICIES, "inference.pd.policy",
          "must be a vllm-router policy (random, round_robin, cache_aware, power_of_two, consistent_hash)", pd.policy)
    need = ROUTER_MIN_WORKERS.get(pd.policy, 0)
    _need(pd.prefill >= need and pd.decode >= need, "inference.pd.policy",
          f"{pd.policy!r} needs at least {need} prefill and {need} decode servers (vllm-router refuses to start "
          f"with fewer), inference.pd.prefill/decode", (pd.prefill, pd.decode))
    _need(pd.resamples >= 0, "inference.pd.resamples", "must be >= 0", pd.resamples)
    _need(pd.launch_timeout_s > 0, "inference.pd.launch_timeout_s", "must be > 0", pd.launch_timeout_s)
    _need(i.kv_cache, "inference.pd", "needs inference.kv_cache = true (the prefill server hands over its cache)",
          i.kv_cache)
    _need(not i.vllm.disaggregation, "inference.vllm.disaggregation",
          "is set per server by inference.pd; leave it empty", i.vllm.disaggregation)
    _need(i.num_servers == 1 and not i.vllm.urls, "inference.pd",
          "starts its own prefill and decode servers: leave inference.num_servers = 1 and inference.vllm.urls empty",
          (i.num_servers, i.vllm.urls))
