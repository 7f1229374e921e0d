"""The memory plan: predicted peak bytes per trainer rank and per inference GPU, before launch.

Pure arithmetic from the model config (``primerl.models.MoETransformerConfig``) and the job's
layout (``trainer.parallel``, precision, ``orchestrator.seq_len``): no tensor is allocated. Each
line follows what the code in ``primerl.models`` / ``primerl.parallel`` keeps alive, so a change
there that changes memory should change a line here (``tests/runtime/test_memory_plan.py``
measures the peaks on gloo ranks against these predictions).

Per trainer rank (S = dp_shard x cp ranks shard the dense weights, the experts are cut to E / ep
per rank and sharded over efsdp = S / ep; t = seq_len / cp tokens of a micro-batch):

  parameters    float32 master shards (bf16 mixed precision) or the stored dtype
  gradients     sharded, the parameter dtype (the frozen sparse-attention indexer has none)
  optimizer     AdamW m and v, the parameter dtype
  fsdp buffers  unsharded compute copies: two blocks (the running one and the prefetched one),
                a block's unsharded gradients (compute dtype) and its float32 reduce-scatter
                input in backward; the head stays unsharded from forward to its backward
  activations   what autograd saves per layer for t tokens (the layer formulas below), all
                layers at the start of backward; under checkpointing a checkpointed block keeps
                its input [t, D] only and is recomputed one at a time (activation_offload moves
                those inputs to the host)
  attention/cp  ring: K/V in flight (two [2, t, Hkv, Dh]) and the float32 output / dQ / dK dV
                accumulators; Ulysses: the all-to-all send and receive buffers of q, k, v, o
  log-probs     fused_logprobs: the float32 grad_hidden [t, D] and its chunk blocks, the head's
                gradient and its float32 reduce-scatter input
  expert a2a    expert parallel: the dispatched rows sent and received ([t k, D], FP8 when
                dispatched in FP8)
  backward      a block's backward working set (gradients of its largest intermediates, less
                what its backward already freed)

The peak is the largest of the backward's phases (the forward's end is never higher: the
backward adds gradients to everything the forward kept):
  head's backward   every block's kept activations + the final norm's + the log-probs chunks
  block i's         the blocks before i keep theirs, block i holds all it saved (recomputed
                    first when checkpointed) + max(MoE working set, expert a2a, attention working
                    set + attention/cp buffers): the two halves run one after the other
on top of parameters + gradients + optimizer + fsdp buffers.

Per inference GPU (vLLM or the embedded engine): the weights (dense / tensor_parallel, experts /
expert-parallel size) and the KV cache per token: GQA 2 x Hkv x Dh per layer (heads split over
tensor_parallel), MLA the compressed latent R + Dr (+ the indexer key Di for DeepSeek sparse
attention) per layer, replicated on every tensor-parallel GPU.

>>> from primerl.runtime.config import load_config
>>> plan = plan_for_config(load_config("examples/plan_glm5_131k.toml"), device_memory=parse_bytes("141GB"))
>>> plan.fits, round(plan.trainer.peak / GiB, 1), plan.max_seq_len      # (True, 87.0, 318464)
>>> print(format_plan(plan))                                             # what `primerl plan` prints
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from .config import ConfigError, RLConfig, cp_degrees, parallel_dims

GiB = 2**30
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"141GB"`` -> 141e9, ``"80GiB"`` -> 80 * 2**30, ``"1024"`` -> 1024 (ValueError otherwise)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"a memory size such as 141GB or 80GiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# ------------------------------------------------------------------------------------------------
# the layout


@dataclass(frozen=True)
class TrainerLayout:
    """What the plan needs of ``trainer.parallel`` and the precision (see :meth:`from_config`)."""

    seq_len: int  # tokens of one packed micro-batch (before the cp split)
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1
    ulysses: int = 1  # cp = ulysses x ring
    activation_checkpointing: str = "none"  # none | full | selective (every ac_every-th block)
    ac_every: int = 2
    activation_offload: bool = False
    cpu_offload: bool = False
    fp8: str = "off"
    fp8_dispatch: bool = False
    mixed_precision: bool = True  # bf16 compute, float32 master weights (FSDP2 MixedPrecisionPolicy)
    param_bytes: int = 4  # the stored (master) dtype
    fsdp: bool = True
    native_lowp: bool = True  # CUDA bf16 GEMMs (fused_logprobs' chunk sizes); False on the CPU
    ref_model: bool = False  # a frozen copy for a KL-to-reference term
    host_is_device: bool = False  # a CPU job: "offloaded" bytes stay in the same memory, CPU-only op paths
    lora_rank: int = 0  # trainer.lora: the base frozen, gradients and AdamW state for the adapters only
    lora_targets: tuple = ()  # () with lora_rank: every target the model has

    @property
    def ring(self) -> int:
        return self.cp // self.ulysses

    @property
    def shard(self) -> int:  # ranks sharing the dense weights (FSDP over dp_shard x cp)
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        return self.shard // self.ep

    @property
    def act_bytes(self) -> int:
        return 2 if self.mixed_precision else self.param_bytes

    @property
    def local_tokens(self) -> int:
        return -(-self.seq_len // self.cp)

    def describe(self) -> str:
        cp = f"cp={self.cp}" if self.cp == 1 else f"cp={self.cp} (ulysses {self.ulysses} x ring {self.ring})"
        prec = "bf16 / fp32 master" if self.mixed_precision else f"{8 * self.param_bytes}-bit"
        extra = [f"ac={self.activation_checkpointing}", f"fp8={self.fp8}", prec]
        if self.activation_offload:
            extra.append("activation offload")
        if self.cpu_offload:
            extra.append("cpu offload")
        if self.lora_rank:
            extra.append(f"LoRA r={self.lora_rank} ({', '.join(self.lora_targets) or 'every target'})")
        return (f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} {cp} ep={self.ep}; "
                + ", ".join(extra) + f"; seq_len={self.seq_len} ({self.local_tokens} per rank)")

    @classmethod
    def from_config(cls, cfg: RLConfig, device: str | None = None) -> "TrainerLayout":
        """The job's layout; ``device`` "cuda" / "cpu" overrides ``cfg.device`` (the plan is usually
        made on a machine without the cluster's GPUs: "auto" counts as cuda)."""
        dims = parallel_dims(cfg)
        p, t = cfg.trainer.parallel, cfg.trainer
        device = device or ("cpu" if cfg.device == "cpu" else "cuda")
        mixed = t.mixed_precision == "bf16" or (t.mixed_precision == "auto" and device == "cuda"
                                                 and cfg.model.dtype == "float32")
        u, _ = cp_degrees(p, dims.cp)
        return cls(seq_len=cfg.orchestrator.seq_len, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard,
                   cp=dims.cp, ep=dims.ep, ulysses=u, activation_checkpointing=p.activation_checkpointing,
                   activation_offload=p.activation_offload, cpu_offload=p.cpu_offload, fp8=p.fp8,
                   mixed_precision=mixed, param_bytes=2 if cfg.model.dtype == "bfloat16" else 4,
                   fsdp=dims.world_size > 1 and t.fsdp or mixed, native_lowp=device == "cuda" and mixed,
                   ref_model=t.loss.ref_kl_coef > 0 and not t.lora.rank,  # LoRA: the policy, adapters off
                   host_is_device=device == "cpu",
                   lora_rank=t.lora.rank, lora_targets=tuple(t.lora.targets))


# ------------------------------------------------------------------------------------------------
# parameter counts


@dataclass(frozen=True)
class ParamCounts:
    dense: int  # per model: everything FSDP shards over dp_shard x cp (embeddings, attention, norms, ...)
    experts: int  # routed expert weights, all layers
    frozen: int  # the sparse-attention indexer (no gradient, no optimizer state)
    head: int  # lm_head (kept unsharded from forward to backward)
    embed: int
    block_dense: tuple[int, ...]  # per layer, dense part (attention, norms, router, shared / dense MLP)
    block_experts: tuple[int, ...]  # per layer, routed experts

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.frozen


def param_counts(mc) -> ParamCounts:
    """Parameters by how they are sharded; the sum is ``sum(p.numel())`` of a ``MoETransformer``."""
    D = mc.dim
    dense_blocks, expert_blocks, frozen = [], [], 0
    for i in range(mc.n_layers):
        if mc.is_mla:
            attn = mc._mla_attention_params()  # its latent norms included
            if mc.attention_bias:
                attn += (mc.q_lora_rank or 0) + mc.kv_lora_rank + mc.qk_rope_head_dim
            if mc.o_proj_bias:
                attn += D
            if mc.is_sparse and mc.indexer_types[i] == "full":
                Hi, Di = mc.index_n_heads, mc.index_head_dim
                frozen += mc.q_lora_rank * Hi * Di + D * Di + 2 * Di + D * Hi
        else:
            qkv = mc.head_dim * (mc.n_heads + 2 * mc.n_kv_heads)
            attn = D * qkv + mc.n_heads * mc.head_dim * D
            attn += qkv if mc.attention_bias else 0
            attn += D if mc.o_proj_bias else 0
            attn += 2 * mc.head_dim if mc.qk_norm else 0
        norms = 2 * D
        if i in mc.dense_layers:
            ffn, experts = 3 * D * mc.ffn_dim, 0
        else:
            ffn = mc.num_experts * D + 3 * mc.num_shared_experts * D * mc.moe_dim
            experts = 3 * mc.num_experts * D * mc.moe_dim
        dense_blocks.append(attn + norms + ffn)
        expert_blocks.append(experts)
    embed = mc.vocab_size * D
    head = 0 if mc.tie_word_embeddings else mc.vocab_size * D
    return ParamCounts(dense=sum(dense_blocks) + embed + head + D, experts=sum(expert_blocks), frozen=frozen,
                       head=head, embed=embed, block_dense=tuple(dense_blocks), block_experts=tuple(expert_blocks))


# ------------------------------------------------------------------------------------------------
# activations: bytes autograd keeps per layer for t tokens


def _norm_saved(t: int, width: int, a: int) -> int:
    """RMSNorm (primerl.models.layers): the float32 input, the normalised value and the output."""
    return t * width * (4 + 2 * a)


def attention_saved(mc, lay: TrainerLayout, t: int, layer: int = 0) -> int:
    """Bytes the attention half of a block saves for t local tokens (input norm included)."""
    a, D, H = lay.act_bytes, mc.dim, mc.n_heads
    saved = _norm_saved(t, D, a)
    rope = 2 * t * mc.rotary_dim * a
    if mc.is_mla:
        return saved + _mla_saved(mc, lay, t, layer) + rope
    Hkv, Dh = mc.n_kv_heads, mc.head_dim
    if mc.qk_norm:  # its output goes to RoPE, which keeps only cos / sin
        saved += t * (H + Hkv) * Dh * (4 + a)
    kv_heads = Hkv
    if lay.ulysses > 1 and Hkv < lay.ulysses:  # KV heads replicated up to one per Ulysses rank
        kv_heads = lay.ulysses
    q_o = 2 * t * H * Dh * a  # q and out (the out is o_proj's input)
    kv = 2 * t * kv_heads * Dh * a
    lse = 4 * H * t
    ulysses_o = t * H * Dh * a if lay.ulysses > 1 else 0  # o_proj's input is the all-to-all's output
    return saved + q_o + kv + lse + rope + ulysses_o


def _mla_saved(mc, lay: TrainerLayout, t: int, layer: int) -> int:
    a, H = lay.act_bytes, mc.n_heads
    R, Dr, Dn, Dv, Dqk = mc.kv_lora_rank, mc.qk_rope_head_dim, mc.qk_nope_head_dim, mc.v_head_dim, mc.head_dim
    saved = _norm_saved(t, R, a)  # kv_a_layernorm
    if mc.q_lora_rank:
        saved += _norm_saved(t, mc.q_lora_rank, a)
    if mc.is_sparse and lay.seq_len > mc.index_topk:
        # absorbed form: q_b's output (q_nope's storage, for q_abs = q_nope @ W_uk), q = [q_abs, q_rope],
        # the latent keys (gathered from every cp rank: seq_len rows), o_lat, W_uv's output (o_proj's
        # input), lse, and the selection [t, K] int32 of a "full" indexer layer
        kv_rows = lay.seq_len if lay.cp > 1 else t
        saved += t * H * Dqk * a + t * H * (R + Dr) * a + kv_rows * (R + Dr) * a
        saved += t * H * R * a + t * H * Dv * a + 4 * H * t
        if mc.indexer_types[layer] == "full":
            saved += 4 * t * mc.index_topk
        if lay.ulysses > 1:  # head-parallel form: o_lat in both layouts, the Ulysses group's selections
            saved += t * H * R * a + 4 * lay.ulysses * t * mc.index_topk
        return saved
    # dense form (primerl.kernels.attention.mla): q, k [t, H, Dqk]; with Dv == Dqk v is a view of
    # kv_b's output [t, H, Dn + Dv] and the output is o_proj's input; else v and the output are
    # zero-padded to the wider head dim and o_proj reads a copy of the output's first Dv columns
    if Dv == Dqk:  # under Ulysses o_proj's input is the all-to-all's output, not the kernel's
        ulysses_o = t * H * Dv * a if lay.ulysses > 1 else 0
        return saved + 2 * t * H * Dqk * a + t * H * (Dn + Dv) * a + t * H * Dv * a + 4 * H * t + ulysses_o
    Dm = max(Dqk, Dv)
    return saved + 2 * t * H * Dm * a + 2 * t * H * Dm * a + t * H * Dv * a + 4 * H * t


def ffn_saved(mc, lay: TrainerLayout, t: int, layer: int) -> int:
    """Bytes the FFN half of a block saves (its norm included): dense SwiGLU, or router + routed
    experts (+ shared experts)."""
    a, D = lay.act_bytes, mc.dim
    saved = _norm_saved(t, D, a)
    if layer in mc.dense_layers:
        return saved + 4 * t * mc.ffn_dim * a  # gate, silu(gate), up, gate*up
    k, E, Id = mc.top_k, mc.num_experts, mc.moe_dim
    m = t * k  # routed rows (balanced over ep ranks)
    saved += (4 * t * D if a != 4 else 0) + 3 * t * E * 4 + 12 * m  # router input in float32, scores, ids/weights
    if _cpu_experts(mc, lay, m):
        experts = m * (2 * Id + D) * 4 + 16 * m  # gu, y_perm (rows and h recomputed in backward), slots, tokens
    elif _fp8_experts(mc, lay):
        x_rows = m * D * (1 if lay.fp8 == "blockwise_fp8_wgrad" else a)
        experts = x_rows + m * 2 * Id * 2 + m * D * a  # x_perm, gu (bf16), y_perm
    else:
        experts = m * (2 * D + 3 * Id) * a  # x_perm, gu, h, y_perm
    if lay.ep > 1:  # the dispatcher's combine keeps each slot's rows in float32, not y_perm; index maps
        experts += (m * D * 4 if a != 4 else 0) - m * D * a + 32 * m
    shared = 4 * t * mc.num_shared_experts * Id * a
    return saved + experts + shared


def layer_saved(mc, lay: TrainerLayout, t: int, layer: int) -> int:
    return attention_saved(mc, lay, t, layer) + ffn_saved(mc, lay, t, layer)


def layer_backward_working(mc, lay: TrainerLayout, t: int, layer: int) -> tuple[int, int]:
    """Growth of live memory during one block's backward at its highest point, ``(ffn, attention)``
    halves (they run one after the other): the gradients of the largest intermediates alive at
    once, less the block's own saved tensors freed before then, plus the residual's gradient.

    MoE half, at SwiGLU's backward: the routed rows' dh [m, I] and dgu [m, 2I], after the shared
    experts' backward (autograd runs it first: it was computed last) and the combine's and the
    down projection's backward freed their saved y_perm and h. On the CPU the reference op
    (``primerl.kernels.moe.reference.swiglu_backward``) also holds gate, up, dh, sigmoid, silu and
    dgate in float32 (6 m I float32). Attention half: dq, dk, dv, dout and the kernel's float32 dQ."""
    a, D = lay.act_bytes, mc.dim
    residual = 2 * t * D * a
    if layer in mc.dense_layers:
        ffn = t * (3 * mc.ffn_dim + D) * a
    else:
        m, Id = t * mc.top_k, mc.moe_dim
        fp8 = _fp8_experts(mc, lay)
        ffn = m * 3 * Id * a
        if not lay.native_lowp and a != 4:
            ffn += 6 * m * Id * 4
        combine = m * D * (4 if lay.ep > 1 and a != 4 else a)  # y_perm, or under EP its float32 slot copies
        freed = 4 * t * mc.num_shared_experts * Id * a + combine + (0 if fp8 else m * Id * a)
        ffn = max(ffn - freed, m * D * a)
    H = mc.n_heads
    Hkv, Dh = (H, max(mc.head_dim, mc.v_head_dim)) if mc.is_mla else (mc.n_kv_heads, mc.head_dim)
    attn = t * H * Dh * (2 * a + 4) + 2 * t * Hkv * Dh * a
    return ffn + residual, attn + residual


def _cpu_experts(mc, lay: TrainerLayout, rows: int) -> bool:
    """The CPU's expert-by-expert float32 path (``primerl.kernels.moe.cpu_experts``), taken without
    expert parallelism when the routed rows are large enough to pay off."""
    from primerl._kernel_sizes import CPU_EXPERTS_MIN_BYTES as MIN_BYTES

    return (lay.host_is_device and lay.act_bytes == 4 and not _fp8_experts(mc, lay) and lay.ep == 1
            and rows * max(2 * mc.moe_dim, mc.dim) * 4 >= MIN_BYTES)


def _fp8_experts(mc, lay: TrainerLayout) -> bool:
    return lay.fp8 != "off" and mc.dim % 128 == 0 and mc.moe_dim % 128 == 0


def cp_buffers(mc, lay: TrainerLayout, t: int) -> int:
    """Context-parallel buffers of one attention call (forward or backward, the larger)."""
    if lay.cp == 1:
        return 0
    a, H = lay.act_bytes, mc.n_heads
    if mc.is_sparse and lay.seq_len > mc.index_topk:
        # DeepSeek sparse form: no ring rotation (the latent KV is all-gathered, kept as saved);
        # Ulysses all-to-alls the absorbed queries [t, H, R + Dr] and the latent outputs [t, H, R]
        R, Dr = mc.kv_lora_rank, mc.qk_rope_head_dim
        out = lay.seq_len * mc.index_head_dim * a  # the gathered indexer keys (no gradient)
        if lay.ulysses > 1:
            out += 2 * t * H * (2 * R + Dr) * a
        return int(out)
    Hkv = mc.n_heads if mc.is_mla else mc.n_kv_heads
    Dh = max(mc.head_dim, mc.v_head_dim) if mc.is_mla else mc.head_dim
    out = 0
    if lay.ring > 1:
        tr = t * lay.ulysses  # ring over the Ulysses-gathered tokens (heads / ulysses)
        hq, hk = H / lay.ulysses, max(Hkv / lay.ulysses, 1)
        kv = 2 * tr * hk * Dh
        out += 2 * kv * a + tr * hq * Dh * 4 + 3 * kv * 4  # K/V + next, dQ (float32), dK/dV accumulators
    if lay.ulysses > 1:
        hk = max(Hkv, lay.ulysses)
        out += 2 * t * (2 * H + 2 * hk) * Dh * a  # q, k, v, o: send + receive
    return int(out)


def expert_a2a_buffers(mc, lay: TrainerLayout, t: int) -> int:
    if lay.ep == 1 or not mc.moe_layer_ids:
        return 0
    m, D = t * mc.top_k, mc.dim
    row = D + 4 * (D // 128) if lay.fp8_dispatch else D * lay.act_bytes
    return 2 * m * row + m * D * lay.act_bytes  # sent, received, regrouped


def logprobs_buffers(mc, lay: TrainerLayout, t: int) -> int:
    """fused_logprobs' backward: float32 grad_hidden, its blocks (``default_chunk_sizes``), the
    head's gradient (compute dtype) and, under FSDP, its float32 reduce-scatter input."""
    from primerl._kernel_sizes import default_chunk_sizes

    a, D, V = lay.act_bytes, mc.dim, mc.vocab_size
    tz, vc, td = default_chunk_sizes(t, V, D, lay.native_lowp)
    tz, vc, td = min(tz, t), min(vc, V), min(td, t)
    blocks = 4 * tz * vc * 2 + td * vc * (a if a != 4 else 4)
    if a != 4 and td < t:
        blocks += 4 * vc * D
    if not lay.native_lowp and a != 4:
        blocks += 4 * vc * D + 4 * t * D  # the CPU upcasts the weight chunk and the rows to float32
    grad_w = V * D * a + (V * D * 4 if lay.fsdp and a != 4 else 0)
    return 4 * t * D + blocks + grad_w + (2 * t * D if a != 4 else 0)


# ------------------------------------------------------------------------------------------------
# the plan


@dataclass
class TrainerPlan:
    """Predicted bytes on one trainer rank (device) and in its host memory."""

    layout: TrainerLayout
    rows: dict[str, int]  # component -> device bytes
    host: dict[str, int] = field(default_factory=dict)  # offloaded component -> host bytes
    peak: int = 0

    def static(self) -> int:
        return sum(self.rows[k] for k in ("parameters", "gradients", "optimizer"))


def lora_counts(mc, rank: int, targets=()) -> tuple[int, int]:
    """``(dense, routed-expert)`` LoRA adapter parameters of ``apply_lora(model, rank, targets)`` on
    a model of config ``mc`` (counted on the meta device)."""
    import torch

    from primerl.models import MoETransformer
    from primerl.models.lora import apply_lora, lora_parameters

    with torch.device("meta"):
        model = apply_lora(MoETransformer(mc), rank, 1.0, targets=tuple(targets) or None)
    dense = experts = 0
    for name, p in lora_parameters(model).items():
        if ".experts." in name:
            experts += p.numel()
        else:
            dense += p.numel()
    return dense, experts


def trainer_plan(mc, lay: TrainerLayout) -> TrainerPlan:
    """The per-rank peak of one optimizer step of ``lay`` on model ``mc``."""
    pc = param_counts(mc)
    S, efsdp = lay.shard, lay.efsdp
    pb, a = lay.param_bytes, lay.act_bytes
    if not lay.fsdp:
        S = efsdp = 1
    local_experts = pc.experts // lay.ep
    trainable = pc.dense / S + local_experts / efsdp
    frozen = pc.frozen / S
    if lay.lora_rank:  # the whole base frozen; the adapters (sharded like their base) train
        ld, le = lora_counts(mc, lay.lora_rank, lay.lora_targets)
        frozen += trainable
        trainable = ld / S + le / lay.ep / efsdp
    params = (trainable + frozen) * pb
    if lay.ref_model:  # a frozen copy, sharded the same way (its forward runs without autograd)
        params += (pc.total / S) * pb
    rows = {"parameters": int(params), "gradients": int(trainable * pb), "optimizer": int(2 * trainable * pb)}
    host = {}
    if lay.cpu_offload and not lay.host_is_device:
        for k in ("parameters", "gradients", "optimizer"):
            host[k], rows[k] = rows[k], 0

    t = lay.local_tokens
    L = mc.n_layers
    # FSDP: two unsharded blocks, one block's unsharded gradients + float32 reduce-scatter input,
    # and the head (kept unsharded from its forward to its backward)
    unsharded = [(pc.block_dense[i] + pc.block_experts[i] / lay.ep) for i in range(L)]
    big = sorted(unsharded, reverse=True)
    if lay.fsdp:
        fsdp = (big[0] + (big[1] if L > 1 else 0)) * a + big[0] * (a + 4) + pc.head * a
        if not lay.mixed_precision and S == 1:
            fsdp = big[0] * pb  # one rank without mixed precision: the gradient buffer only
    else:
        fsdp = 0
    rows["fsdp buffers"] = int(fsdp)

    saved = [layer_saved(mc, lay, t, i) for i in range(L)]
    ckpt = _checkpointed(lay, L)
    block_input = t * mc.dim * a
    # what a block keeps from its forward to its backward: all it saved, or, checkpointed, its
    # input (on the host under activation_offload: two in flight on the device, the block being
    # copied back and the next)
    offload = lay.activation_offload and any(ckpt) and not lay.host_is_device
    kept = [(0 if offload else block_input) if ckpt[i] else saved[i] for i in range(L)]
    in_flight = 2 * block_input if offload else 0
    if offload:
        host["checkpointed inputs"] = sum(ckpt) * block_input
    final_norm = t * mc.dim * (4 + a)  # its output is fused_logprobs' input, kept by that Function
    rows["activations"] = int(sum(kept) + in_flight + final_norm)
    rows["recomputed block"] = max([saved[i] for i in range(L) if ckpt[i]], default=0)
    rows["attention / cp buffers"] = cp_buffers(mc, lay, t)
    rows["log-probs chunks"] = logprobs_buffers(mc, lay, t)
    rows["expert all-to-all"] = expert_a2a_buffers(mc, lay, t)
    # backward of block i: blocks before it keep what they saved (a checkpointed one its input),
    # block i holds all it saved (recomputed when checkpointed) and its working set; blocks after
    # it are done. Its two halves run in turn (attention with the CP buffers).
    phases, below = [], in_flight
    for i in range(L):
        ffn, attn = layer_backward_working(mc, lay, t, i)
        # the exchange's buffers live while the combine's / dispatch's backward runs, not SwiGLU's
        work = max(ffn, rows["expert all-to-all"], attn + rows["attention / cp buffers"])
        phases.append(below + saved[i] + (block_input if ckpt[i] else 0) + work)
        below += kept[i]
    worst = max(range(L), key=lambda i: phases[i])
    rows["backward working set"] = int(phases[worst] - in_flight - sum(kept[:worst]) - saved[worst])
    static = sum(rows[k] for k in ("parameters", "gradients", "optimizer", "fsdp buffers"))
    # the head's backward: every block's kept tensors, the final norm's, the log-probs blocks
    head_phase = sum(kept) + in_flight + final_norm + rows["log-probs chunks"]
    peak = static + max(head_phase, phases[worst])
    return TrainerPlan(lay, rows, host, int(peak))


def _checkpointed(lay: TrainerLayout, L: int) -> list[bool]:
    if lay.activation_checkpointing == "full":
        return [True] * L
    if lay.activation_checkpointing == "selective":
        return [i % lay.ac_every == 0 for i in range(L)]
    return [False] * L


def max_seq_len(mc, lay: TrainerLayout, device_memory: int, *, multiple: int = 1024) -> int:
    """The largest seq_len (a multiple of ``multiple`` and of 2 cp) whose predicted peak fits in
    ``device_memory`` bytes; 0 when not even the smallest does."""
    step = math.lcm(multiple, 2 * lay.cp)

    def fits(n: int) -> bool:
        return trainer_plan(mc, replace(lay, seq_len=n)).peak <= device_memory

    if not fits(step):
        return 0
    lo, hi = 1, 2
    while fits(hi * step) and hi < 2**24:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step


# ------------------------------------------------------------------------------------------------
# inference


@dataclass(frozen=True)
class InferencePlan:
    gpus: int  # GPUs of one server (tensor_parallel x data_parallel)
    weights: int  # bytes per GPU
    kv_per_token: int  # bytes per token per GPU holding it
    kv_tokens: int  # tokens of KV cache that fit in the rest (gpu_memory_utilization); 0 unknown
    describe: str


def inference_plan(mc, *, tensor_parallel: int = 1, data_parallel: int = 1, expert_parallel: bool = False,
                   weight_bytes: float = 2, kv_bytes: int = 2, device_memory: int = 0,
                   utilization: float = 0.9) -> InferencePlan:
    """One inference server: weights and KV cache per GPU (vLLM's layouts: attention split over
    tensor_parallel, experts over data_parallel x tensor_parallel with expert_parallel, else over
    tensor_parallel; MLA's latent cache is not split by heads, so every GPU of a TP group holds it)."""
    pc = param_counts(mc)
    tp, dp = tensor_parallel, data_parallel
    ep = tp * dp if expert_parallel else tp
    w = pc.dense / tp + pc.experts / ep + pc.frozen  # the indexer replicated
    weights = int(w * weight_bytes)
    if mc.is_mla:
        width = mc.kv_lora_rank + mc.qk_rope_head_dim + (mc.index_head_dim if mc.is_sparse else 0)
        kv = mc.n_layers * width * kv_bytes
        what = f"MLA latent {width} values/token/layer"
    else:
        heads = max(mc.n_kv_heads // tp, 1)
        kv = mc.n_layers * 2 * heads * mc.head_dim * kv_bytes
        what = f"K+V {2 * heads} heads x {mc.head_dim}/token/layer"
    tokens = 0
    if device_memory:
        tokens = max(int((device_memory * utilization - weights) // kv), 0)
    return InferencePlan(tp * dp, weights, kv, tokens,
                         f"tp={tp} dp={dp} ep={'on' if expert_parallel else 'off'}; {what}")


# ------------------------------------------------------------------------------------------------
# from a job config, and the table


@dataclass
class Plan:
    model: object  # MoETransformerConfig
    trainer: TrainerPlan
    inference: InferencePlan
    device_memory: int
    max_seq_len: int

    @property
    def fits(self) -> bool:
        return self.trainer.peak <= self.device_memory


def plan_for_config(cfg: RLConfig, *, device_memory: int = 141 * 10**9, seq_len: int | None = None,
                    device: str | None = None) -> Plan:
    """The plan of a job config (``seq_len`` overrides ``orchestrator.seq_len``)."""
    from .policy import model_config

    vocab = 1
    if not cfg.model.path and not cfg.model.vocab_size:  # the environment's vocabulary: build it
        from .config import load_policy_env, policy_env

        try:
            vocab = load_policy_env(cfg).vocab_size
        except Exception as e:  # e.g. an optional package the environment needs is not installed here
            vocab = _tokenizer_vocab(policy_env(cfg).args)  # its tokenizer's size, without the environment's package
            if vocab is None:
                raise ConfigError(f"model.vocab_size: 0 takes the environment's vocab_size, and building env.id = "
                                  f"{policy_env(cfg).id!r} here failed ({type(e).__name__}: {e}); set "
                                  "--model.vocab_size for the plan") from None
    mc = model_config(cfg, vocab)
    lay = TrainerLayout.from_config(cfg, device)
    if seq_len is not None:
        if seq_len < 1:
            raise ConfigError(f"--seq-len must be >= 1, got {seq_len}")
        lay = replace(lay, seq_len=seq_len)
    from .inference.backend import get_backend

    inf = get_backend(cfg).inference_plan(cfg, mc, lay, device_memory)  # one server of the job's backend
    return Plan(mc, trainer_plan(mc, lay), inf, device_memory, max_seq_len(mc, lay, device_memory))


def _tokenizer_vocab(env_args: dict) -> int | None:
    """The size of ``env.args.tokenizer`` (the vocabulary an environment with a tokenizer has), read
    without building the environment: the built-in ``builtin:qwen3-tiny`` is ``QWEN3_TINY_VOCAB``
    ids by construction; a path is loaded with transformers. None without a tokenizer (or transformers)."""
    tok = env_args.get("tokenizer") if isinstance(env_args, dict) else None
    if not tok:
        return None
    if tok == "builtin:qwen3-tiny":
        from primerl.rl.envs.vf_tokenizer import QWEN3_TINY_VOCAB

        return QWEN3_TINY_VOCAB
    try:
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(str(tok)))
    except Exception:  # noqa: BLE001 - not readable here: the caller asks for model.vocab_size
        return None


def _count(n: float) -> str:
    return f"{n / 1e9:.4g}B" if n >= 1e9 else f"{n / 1e6:.4g}M"


def format_plan(plan: Plan) -> str:
    """The per-rank table and the verdict, as ``#`` comment lines (``--dry-run`` prints them too)."""
    tp, lay = plan.trainer, plan.trainer.layout
    mc = plan.model
    pc = param_counts(mc)
    unit, scale = ("GiB", GiB) if tp.peak >= GiB else ("MiB", 2**20)
    out = [f"# memory plan: {mc.family}, {_count(pc.total)} parameters ({_count(pc.experts)} in routed experts)",
           f"# trainer rank: {lay.describe()}",
           f"#   {'component':<28} {unit + ' / rank':>12}"]
    bits = 8 * lay.param_bytes
    labels = {"parameters": f"parameters ({'fp32 master' if lay.mixed_precision else f'{bits}-bit'})",
              "optimizer": "optimizer (AdamW m, v)"}
    for k, v in tp.rows.items():
        out.append(f"#   {labels.get(k, k):<28} {v / scale:12.3f}")
    out.append(f"#   {'peak (predicted)':<28} {tp.peak / scale:12.3f}")
    for k, v in tp.host.items():
        out.append(f"#   host: {k:<22} {v / scale:12.3f}")
    t = lay.local_tokens
    out.append(f"#   per token on this rank: {tp.rows['activations'] / t / 2**10:.1f} KiB kept to the backward, "
               f"{tp.rows['recomputed block'] / t / 2**10:.1f} KiB for the recomputed block")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    out.append(f"# verdict: {verdict} in {plan.device_memory / 1e9:g} GB ({plan.device_memory / GiB:.1f} GiB) per "
               f"device; largest seq_len that fits this layout: {plan.max_seq_len}")
    inf = plan.inference
    out.append(f"# inference server ({inf.describe}): weights {inf.weights / GiB:.3f} GiB per GPU, KV cache "
               f"{inf.kv_per_token / 2**10:.1f} KiB per token"
               + (f", room for {inf.kv_tokens} tokens" if inf.kv_tokens else ""))
    return "\n".join(out) + "\n"
