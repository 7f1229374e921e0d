"""The predicted weight-update time (issue 42): ``primerl plan --link-gbps G`` prints it.

A model of the bucketed transfer (``inference.weight_transfer``), not a measurement: one version's
bytes (``full``: the engine's dtype, 2 bytes a parameter in bf16; ``fp8``: 1 byte + a float32
scale per 128x128 block; ``delta``: ``delta_fraction`` of the full bytes on the wire, after xor +
zstd) cross the slower of two sides:

- the senders: every trainer rank with its own link when the transfer is sharded (one link, rank
  0's, when it is not): ``senders x link``;
- a receiver: every inference replica takes the whole version, each of its GPUs on its own link
  (``receiver_gpus x link``); replicas receive in parallel (a broadcast tree pipelines the buckets,
  so R replicas cost about one), which is what the published figures' systems do too.

``link_gbps``: one GPU's network link in Gb/s (the seed's 400 Gb/s RDMA, one NIC per GPU); when the
trainer and inference share a node the link is NVLink (``nvlink_gbs`` GB/s per GPU). A delta also
pays for its xor + zstd on the CPU: ``delta_codec_gbs`` GB/s of full bytes per sending rank
(measured on this machine by ``python -m bench weights``), overlapped with the wire (the larger wins).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UpdateEstimate", "estimate_update", "format_update_plan", "version_bytes"]

NVLINK_GBS = 450.0  # H100/H200 NVLink 4: 900 GB/s bidirectional per GPU
FP8_BLOCK_ELEMS = 128 * 128


def version_bytes(params: float, form: str, *, dtype_bytes: int = 2, delta_fraction: float = 1.0) -> float:
    """Bytes of one version on the wire: ``form`` "full", "fp8" or "delta"."""
    if form == "full":
        return params * dtype_bytes
    if form == "fp8":
        return params * (1 + 4 / FP8_BLOCK_ELEMS)
    if form == "delta":
        return params * dtype_bytes * delta_fraction
    raise ValueError(f"version_bytes: form must be full, fp8 or delta, got {form!r}")


@dataclass
class UpdateEstimate:
    form: str
    bytes: float
    seconds: float
    bound: str  # "senders", "receiver" or "codec"


def estimate_update(params: float, *, senders: int, receiver_gpus: int = 1, link_gbps: float = 400.0,
                    nvlink: bool = False, dtype_bytes: int = 2, delta_fraction: float = 0.3,
                    delta_codec_gbs: float = 1.0) -> list[UpdateEstimate]:
    """Full / FP8 / delta estimates for one version of ``params`` parameters."""
    if senders < 1 or receiver_gpus < 1 or link_gbps <= 0:
        raise ValueError("estimate_update: senders, receiver_gpus >= 1 and link_gbps > 0")
    link = NVLINK_GBS * 1e9 if nvlink else link_gbps * 1e9 / 8  # bytes/s of one GPU's link
    send_bw, recv_bw = senders * link, receiver_gpus * link
    out = []
    for form in ("full", "fp8", "delta"):
        b = version_bytes(params, form, dtype_bytes=dtype_bytes, delta_fraction=delta_fraction)
        t, bound = (b / send_bw, "senders") if send_bw < recv_bw else (b / recv_bw, "receiver")
        if form == "delta":
            codec = params * dtype_bytes / (senders * delta_codec_gbs * 1e9)
            if codec > t:
                t, bound = codec, "codec"
        out.append(UpdateEstimate(form, b, t, bound))
    return out


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def format_update_plan(cfg, params: float, *, link_gbps: float = 400.0) -> str:
    """The ``primerl plan`` lines for a job config (its trainer ranks, sharding, receiver GPUs)."""
    w = cfg.inference.weight_transfer
    senders = cfg.num_trainer_ranks if w.sharded else 1
    receiver_gpus = max(1, cfg.inference.vllm.tensor_parallel) if cfg.inference.backend == "vllm" else 1
    d = cfg.deployment  # NVLink: the trainer ranks and the receiver's GPUs fit one node of 8 GPUs
    nvlink = (not d.inference_nodes and d.orchestrator != "own" and d.trainer_nodes == 1
              and cfg.num_trainer_ranks + receiver_gpus <= 8)
    where = f"NVLink {NVLINK_GBS:g} GB/s per GPU (one node)" if nvlink else f"{link_gbps:g} Gb/s per GPU link"
    lines = [f"# weight update (predicted, primerl.runtime.update_plan): {params / 1e9:.4g}B parameters, "
             f"{senders} sending rank(s), a receiver of {receiver_gpus} GPU(s), {where}"]
    for e in estimate_update(params, senders=senders, receiver_gpus=receiver_gpus, link_gbps=link_gbps,
                             nvlink=nvlink):
        note = " (delta_fraction 0.3 assumed, xor + zstd at 1 GB/s per rank)" if e.form == "delta" else ""
        lines.append(f"#   {e.form:5s} {e.bytes / 1e9:8.3f} GB  {_fmt_s(e.seconds):>10s}  bound by the {e.bound}{note}")
    return "\n".join(lines) + "\n"
