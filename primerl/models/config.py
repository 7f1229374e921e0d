"""MoETransformerConfig: one dataclass for the Qwen3-MoE and GLM-4.5-MoE families, and its mapping
to and from a Hugging Face ``config.json``.

Family differences the config captures (everything else is shared: pre-norm decoder, GQA attention
with rotate-half RoPE, SwiGLU experts):

=====================  =====================================  ===========================================
                       Qwen3-MoE (``qwen3_moe``)               GLM-4.5-MoE (``glm4_moe``)
=====================  =====================================  ===========================================
router                 softmax, optional renormalised top-k   sigmoid + score-correction bias, group-limited
                                                              top-k, renormalised, ``routed_scaling_factor``
shared experts         none                                   ``n_shared_experts`` x ``moe_intermediate_size``
dense layers           ``mlp_only_layers``/``decoder_sparse``  the first ``first_k_dense_replace`` layers
q/k RMSNorm            always                                 ``use_qk_norm``
rotary                 full head dim                          ``partial_rotary_factor`` (0.5) of the head dim
o_proj bias            ``attention_bias``                     never
=====================  =====================================  ===========================================
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3", "glm_moe_dsa")
MLA_FAMILIES = ("deepseek_v3", "glm_moe_dsa")  # multi-head latent attention (see primerl/models/mla.py)
_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                  "deepseek_v3": "DeepseekV3ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


class UnsupportedCheckpointError(ValueError):
    """A checkpoint (or its config) describes a model this package cannot represent."""


@dataclass
class MoETransformerConfig:
    """Hyper-parameters of a decoder-only MoE transformer.

    Names follow the model code (``dim``, ``moe_dim``); :meth:`from_hf` / :meth:`to_hf` translate to
    Hugging Face's ``config.json`` keys. ``dense_layers`` lists the layers whose FFN is a dense SwiGLU
    of width ``ffn_dim`` instead of an MoE; routing tensors (``routing()``, ``replay_ids``) have one
    column per MoE layer, in layer order (:attr:`moe_layer_ids`).
    """

    family: str = "qwen3_moe"
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 128  # width of the dense SwiGLU layers
    moe_dim: int = 32  # width of one expert
    num_experts: int = 4
    top_k: int = 2
    num_shared_experts: int = 0  # the shared expert has width num_shared_experts * moe_dim
    score_func: str = "softmax"  # "softmax" | "sigmoid"
    route_norm: bool = False  # renormalise the top-k weights to sum to one
    route_scale: float = 1.0
    n_groups: int = 1
    topk_groups: int = 1
    use_expert_bias: bool = False  # aux-loss-free score-correction bias (changes selection only)
    dense_layers: tuple[int, ...] = ()
    qk_norm: bool = True
    attention_bias: bool = False  # q/k/v projection bias
    o_proj_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    dtype: str = "float32"  # parameter dtype the checkpoint declares (router/expert bias stay float32)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Multi-head latent attention (deepseek_v3 / glm_moe_dsa; kv_lora_rank 0 = GQA). head_dim is then
    # the query/key head width qk_nope_head_dim + qk_rope_head_dim and n_kv_heads == n_heads.
    q_lora_rank: int | None = None  # None: one full q projection
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True  # DeepSeek's interleaved rotary pairs on the rope part
    # YaRN context extension of the rope part (DeepSeek-V3 / Kimi-K2 checkpoints): Hugging Face's
    # rope_parameters keys factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
    # mscale_all_dim (optional: attention_factor, truncate). None: plain RoPE.
    rope_yarn: dict | None = None
    # DeepSeek sparse attention (glm_moe_dsa): a lightning indexer picks index_topk keys per query.
    index_n_heads: int = 0  # 0: dense attention
    index_head_dim: int = 0
    index_topk: int = 0
    indexer_types: tuple[str, ...] = ()  # per layer "full" (own indexer) or "shared" (the previous full layer's keys)
    # primerl.kernels.attention backend for every layer (None: the op's default; "sdpa": torch's fused
    # kernels, the fast choice on CPU). A runtime choice, not part of the checkpoint: never written to
    # config.json, and settable after loading (``model.config.attn_backend = "sdpa"``).
    attn_backend: str | None = field(default=None, compare=False)
    # Keys of the Hugging Face config this one was read from, kept so save_pretrained writes them back.
    hf_extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        self.dense_layers = tuple(sorted(int(i) for i in self.dense_layers))
        self.indexer_types = tuple(self.indexer_types)
        if self.is_sparse and not self.indexer_types:
            self.indexer_types = ("full",) * self.n_layers
        self.validate()

    # ----------------------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ValueError(f"MoETransformerConfig: {what}")

        need(self.family in FAMILIES, f"family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "top_k"):
            need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        need(self.n_heads % self.n_kv_heads == 0,
             f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        need(self.head_dim % 2 == 0, f"head_dim must be even, got {self.head_dim}")
        need(self.rope_theta > 1.0, f"rope_theta must be > 1 (the rotary base), got {self.rope_theta}")
        need(self.attn_backend is None or isinstance(self.attn_backend, str),
             f"attn_backend must be None or a backend name such as 'sdpa', got {self.attn_backend!r}")
        need(self.score_func in ("softmax", "sigmoid"),
             f"score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        need(0.0 < self.partial_rotary_factor <= 1.0,
             f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        need(self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
             f"rotary dim int(head_dim * partial_rotary_factor) = {self.rotary_dim} must be even and positive")
        need(all(0 <= i < self.n_layers for i in self.dense_layers),
             f"dense_layers must be layer indices in [0, {self.n_layers}), got {self.dense_layers}")
        if self.moe_layer_ids:
            need(self.num_experts > 0 and self.moe_dim > 0,
                 "num_experts and moe_dim must be positive when any layer is MoE")
            need(self.top_k <= self.num_experts, f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
            need(self.num_experts % self.n_groups == 0,
                 f"num_experts ({self.num_experts}) must be a multiple of n_groups ({self.n_groups})")
            need(1 <= self.topk_groups <= self.n_groups,
                 f"topk_groups must be in [1, n_groups={self.n_groups}], got {self.topk_groups}")
        if self.dense_layers:
            need(self.ffn_dim > 0, "ffn_dim must be positive when dense_layers is not empty")
        need((self.family in MLA_FAMILIES) == self.is_mla,
             f"kv_lora_rank must be positive exactly for the MLA families {MLA_FAMILIES} (family {self.family!r}, "
             f"kv_lora_rank {self.kv_lora_rank})")
        if self.is_mla:
            for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                need(getattr(self, name) > 0, f"{name} must be positive for MLA, got {getattr(self, name)}")
            need(self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
            need(self.head_dim == self.qk_nope_head_dim + self.qk_rope_head_dim,
                 f"MLA head_dim must be qk_nope_head_dim + qk_rope_head_dim = "
                 f"{self.qk_nope_head_dim + self.qk_rope_head_dim}, got {self.head_dim}")
            need(self.n_kv_heads == self.n_heads,
                 f"MLA needs n_kv_heads == n_heads, got {self.n_kv_heads} and {self.n_heads}")
            need(self.q_lora_rank is None or self.q_lora_rank > 0,
                 f"q_lora_rank must be None or positive, got {self.q_lora_rank}")
        if self.rope_yarn is not None:
            need(self.is_mla, "rope_yarn is supported for the MLA families only")
            need(self.rope_yarn.get("factor", 0) > 0 and self.rope_yarn.get("original_max_position_embeddings", 0) > 0,
                 f"rope_yarn needs factor and original_max_position_embeddings > 0, got {self.rope_yarn}")
        need((self.family == "glm_moe_dsa") == self.is_sparse,
             f"index_n_heads > 0 (DeepSeek sparse attention) exactly for glm_moe_dsa (family {self.family!r})")
        if self.is_sparse:
            need(self.q_lora_rank is not None,
                 "the sparse-attention indexer reads the q low-rank latent: q_lora_rank needed")
            need(self.index_head_dim >= self.qk_rope_head_dim and self.index_topk > 0,
                 f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim ({self.qk_rope_head_dim}) and "
                 f"index_topk ({self.index_topk}) positive")
            need(len(self.indexer_types) == self.n_layers and set(self.indexer_types) <= {"full", "shared"}
                 and self.indexer_types[0] == "full",
                 f"indexer_types must be n_layers={self.n_layers} entries of 'full'/'shared' starting with 'full', "
                 f"got {self.indexer_types}")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_sparse(self) -> bool:
        return self.index_n_heads > 0

    @property
    def rotary_dim(self) -> int:
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        dense = set(self.dense_layers)
        return tuple(i for i in range(self.n_layers) if i not in dense)

    def routing_dtype(self):
        """Smallest unsigned integer dtype that holds an expert id."""
        import torch

        if self.num_experts <= 2**8:
            return torch.uint8
        if self.num_experts <= 2**16:
            return torch.uint16
        return torch.uint32

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, vocab_size: int = 256, family: str = "qwen3_moe", **overrides) -> "MoETransformerConfig":
        """A ~2-layer d=64 4-expert model for tests, toy RL tasks and the embedded engine's tests."""
        base: dict[str, Any] = dict(family=family, vocab_size=vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                    head_dim=16, ffn_dim=128, moe_dim=32, num_experts=4, top_k=2)
        if family == "glm4_moe":
            base.update(n_layers=3, num_experts=8, num_shared_experts=1, score_func="sigmoid", route_norm=True,
                        route_scale=2.5, n_groups=2, topk_groups=1, use_expert_bias=True, dense_layers=(0,),
                        qk_norm=False, partial_rotary_factor=0.5, rms_norm_eps=1e-5)
        elif family in MLA_FAMILIES:
            base.update(n_layers=3, n_kv_heads=4, num_experts=8, num_shared_experts=1, score_func="sigmoid",
                        route_norm=True, route_scale=2.5, n_groups=2, topk_groups=1, use_expert_bias=True,
                        dense_layers=(0,), qk_norm=False, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, head_dim=24, v_head_dim=16)
            if family == "glm_moe_dsa":
                base.update(v_head_dim=24, index_n_heads=4, index_head_dim=16, index_topk=16, rms_norm_eps=1e-5)
        base.update(overrides)
        return cls(**base)

    def _mla_attention_params(self) -> int:
        H, qk, r = self.n_heads, self.head_dim, self.q_lora_rank
        q = self.dim * H * qk if r is None else self.dim * r + r + r * H * qk
        kv = self.dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank \
            + self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + H * self.v_head_dim * self.dim

    def _indexer_params(self) -> int:
        Hi, Di = self.index_n_heads, self.index_head_dim
        per = self.q_lora_rank * Hi * Di + self.dim * Di + 2 * Di + self.dim * Hi
        return per * sum(t == "full" for t in self.indexer_types)

    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.is_mla:
            attn = self._mla_attention_params()
        moe = 3 * self.num_experts * self.dim * self.moe_dim + self.num_experts * self.dim \
            + 3 * self.num_shared_experts * self.dim * self.moe_dim
        dense = 3 * self.dim * self.ffn_dim
        layers = self.n_layers * attn + len(self.moe_layer_ids) * moe + len(self.dense_layers) * dense
        if self.is_sparse:
            layers += self._indexer_params()
        emb = self.vocab_size * self.dim * (1 if self.tie_word_embeddings else 2)
        return layers + emb

    def num_active_params(self) -> int:
        full = self.num_params()
        idle = len(self.moe_layer_ids) * 3 * (self.num_experts - self.top_k) * self.dim * self.moe_dim
        return full - idle

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any] | str | os.PathLike) -> "MoETransformerConfig":
        """Read a Hugging Face config (a dict, a ``config.json`` path or a checkpoint directory)."""
        if not isinstance(hf, dict):
            path = os.fspath(hf)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no config.json at {path}")
            with open(path) as f:
                hf = json.load(f)
        hf = dict(hf)
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            archs = hf.get("architectures")
            raise UnsupportedCheckpointError(
                f"unknown architecture: model_type={model_type!r} architectures={archs!r}; "
                f"supported model_type values are {FAMILIES}")

        def get(key, default=None):
            return hf.get(key, default)

        rope = dict(get("rope_parameters") or get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if model_type in MLA_FAMILIES and rope_type not in ("default", "yarn"):
            raise UnsupportedCheckpointError(f"{model_type}: rope_type {rope_type!r} is not supported (only 'default' "
                                             f"and 'yarn')")
        if rope_type != "default" and model_type not in MLA_FAMILIES:
            raise UnsupportedCheckpointError(f"rope_type {rope_type!r} is not supported (only 'default' RoPE)")
        rope_theta = rope.get("rope_theta", get("rope_theta", 10000.0))
        head_dim = get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        act = get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedCheckpointError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
        n_layers = hf["num_hidden_layers"]
        common = dict(
            family=model_type, vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=n_layers,
            n_heads=hf["num_attention_heads"], n_kv_heads=get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=head_dim, ffn_dim=get("intermediate_size", 0), moe_dim=hf["moe_intermediate_size"],
            top_k=hf["num_experts_per_tok"], attention_bias=bool(get("attention_bias", False)),
            rope_theta=float(rope_theta), max_position_embeddings=get("max_position_embeddings", 32768),
            rms_norm_eps=get("rms_norm_eps", 1e-6), tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            initializer_range=get("initializer_range", 0.02),
            dtype=str(get("dtype") or get("torch_dtype") or "float32").replace("torch.", ""),
            bos_token_id=get("bos_token_id"), eos_token_id=get("eos_token_id"), pad_token_id=get("pad_token_id"),
        )
        if model_type == "qwen3_moe":
            if get("use_sliding_window", False):
                raise UnsupportedCheckpointError("qwen3_moe with use_sliding_window=True is not supported")
            step = get("decoder_sparse_step", 1) or 1
            mlp_only = set(get("mlp_only_layers") or [])
            num_experts = get("num_experts", get("num_local_experts"))
            if num_experts is None:
                raise UnsupportedCheckpointError("qwen3_moe config has neither num_experts nor num_local_experts")
            dense = tuple(i for i in range(n_layers) if i in mlp_only or num_experts == 0 or (i + 1) % step != 0)
            cfg = cls(**common, num_experts=num_experts, num_shared_experts=0, score_func="softmax",
                      route_norm=bool(get("norm_topk_prob", False)), route_scale=1.0, n_groups=1, topk_groups=1,
                      use_expert_bias=False, dense_layers=dense, qk_norm=True,
                      o_proj_bias=bool(get("attention_bias", False)),
                      partial_rotary_factor=float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))))
        elif model_type in MLA_FAMILIES:
            cfg = cls(**_mla_from_hf(hf, common, n_layers))
        else:
            cfg = cls(**common, num_experts=get("n_routed_experts", get("num_local_experts")),
                      num_shared_experts=get("n_shared_experts", 1), score_func="sigmoid",
                      route_norm=bool(get("norm_topk_prob", True)),
                      route_scale=float(get("routed_scaling_factor", 1.0)), n_groups=get("n_group", 1),
                      topk_groups=get("topk_group", 1), use_expert_bias=True,
                      dense_layers=tuple(range(min(get("first_k_dense_replace", 1), n_layers))),
                      qk_norm=bool(get("use_qk_norm", False)), o_proj_bias=False,
                      partial_rotary_factor=float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.5))))
        cfg.hf_extra = hf
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict (keys read at load time are kept, ours overwrite)."""
        out = dict(self.hf_extra)
        out.update(
            model_type=self.family, architectures=[_ARCHITECTURES[self.family]], vocab_size=self.vocab_size,
            hidden_size=self.dim, num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads, head_dim=self.head_dim, moe_intermediate_size=self.moe_dim,
            num_experts_per_tok=self.top_k, attention_bias=self.attention_bias, hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings, initializer_range=self.initializer_range, dtype=self.dtype,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
        )
        out.pop("torch_dtype", None)
        out.pop("rope_scaling", None)
        out.pop("rope_theta", None)
        out.pop("partial_rotary_factor", None)
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_yarn:
            rope = {"rope_type": "yarn", "rope_theta": self.rope_theta, **self.rope_yarn}
        if self.is_mla:
            self._mla_to_hf(out)
        elif self.family == "qwen3_moe":
            self._check_hf_expressible(num_shared_experts=0, score_func="softmax", route_scale=1.0, n_groups=1,
                                       topk_groups=1, use_expert_bias=False, qk_norm=True,
                                       o_proj_bias=self.attention_bias)
            dense = set(self.dense_layers)
            key = "num_local_experts" if "num_local_experts" in out else "num_experts"
            out.update({key: self.num_experts}, norm_topk_prob=self.route_norm, decoder_sparse_step=1,
                       mlp_only_layers=sorted(dense), intermediate_size=self.ffn_dim or self.moe_dim,
                       use_sliding_window=False)
            if self.partial_rotary_factor != 1.0:
                rope["partial_rotary_factor"] = self.partial_rotary_factor
        else:
            k = len(self.dense_layers)
            if self.dense_layers != tuple(range(k)):
                raise ValueError(f"glm4_moe needs dense layers to be the first k layers, got {self.dense_layers}")
            self._check_hf_expressible(score_func="sigmoid", use_expert_bias=True, o_proj_bias=False)
            key = "num_local_experts" if "num_local_experts" in out else "n_routed_experts"
            out.update({key: self.num_experts}, n_shared_experts=self.num_shared_experts,
                       norm_topk_prob=self.route_norm, routed_scaling_factor=self.route_scale, n_group=self.n_groups,
                       topk_group=self.topk_groups, first_k_dense_replace=k, use_qk_norm=self.qk_norm,
                       intermediate_size=self.ffn_dim or self.moe_dim)
            rope["partial_rotary_factor"] = self.partial_rotary_factor
        out["rope_parameters"] = rope
        return out

    def _mla_to_hf(self, out: dict[str, Any]) -> None:
        k = len(self.dense_layers)
        if self.dense_layers != tuple(range(k)):
            raise ValueError(f"{self.family} needs dense layers to be the first k layers, got {self.dense_layers}")
        self._check_hf_expressible(score_func="sigmoid", use_expert_bias=True, qk_norm=False,
                                   o_proj_bias=self.attention_bias)
        out.update(n_routed_experts=self.num_experts, n_shared_experts=self.num_shared_experts,
                   norm_topk_prob=self.route_norm, routed_scaling_factor=self.route_scale, n_group=self.n_groups,
                   topk_group=self.topk_groups, first_k_dense_replace=k, intermediate_size=self.ffn_dim or self.moe_dim,
                   q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                   qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                   v_head_dim=self.v_head_dim, head_dim=self.qk_rope_head_dim)
        out.pop("num_local_experts", None)
        if self.family == "deepseek_v3":
            out["rope_interleave"] = self.rope_interleave
        else:
            if not self.rope_interleave:
                raise ValueError("glm_moe_dsa always uses interleaved RoPE; rope_interleave=False is not expressible")
            out.update(index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim,
                       index_topk=self.index_topk, indexer_types=list(self.indexer_types),
                       mlp_layer_types=["dense" if i in self.dense_layers else "sparse" for i in range(self.n_layers)])

    def _check_hf_expressible(self, **required) -> None:
        for name, value in required.items():
            if getattr(self, name) != value:
                raise ValueError(f"a {self.family} Hugging Face config cannot express {name}={getattr(self, name)!r} "
                                 f"(it requires {value!r})")

    def replace(self, **changes) -> "MoETransformerConfig":
        return dataclasses.replace(self, **changes)


def _mla_from_hf(hf: dict[str, Any], common: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """Constructor arguments for a deepseek_v3 / glm_moe_dsa config.json (MoE parts as glm4_moe)."""
    model_type = hf["model_type"]
    nope, rope_dim = hf.get("qk_nope_head_dim", 128), hf.get("qk_rope_head_dim", 64)
    n_heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or n_heads) != n_heads:
        raise UnsupportedCheckpointError(f"{model_type}: num_key_value_heads must equal num_attention_heads for MLA")
    if hf.get("n_routed_experts", hf.get("num_local_experts")) is None:
        raise UnsupportedCheckpointError(f"{model_type}: config has no n_routed_experts (a dense MLA model)")
    if model_type == "glm_moe_dsa" and hf.get("mlp_layer_types") is not None:
        dense = tuple(i for i, t in enumerate(hf["mlp_layer_types"]) if t == "dense")
    else:
        dense = tuple(range(min(hf.get("first_k_dense_replace", 3 if model_type == "glm_moe_dsa" else 1) or 0,
                                n_layers)))
    args = dict(common, head_dim=nope + rope_dim, n_kv_heads=n_heads,
                num_experts=hf.get("n_routed_experts", hf.get("num_local_experts")),
                num_shared_experts=hf.get("n_shared_experts", 1), score_func="sigmoid",
                route_norm=bool(hf.get("norm_topk_prob", True)),
                route_scale=float(hf.get("routed_scaling_factor", 1.0)),
                n_groups=hf.get("n_group") or 1, topk_groups=hf.get("topk_group") or 1, use_expert_bias=True,
                dense_layers=dense, qk_norm=False, o_proj_bias=bool(hf.get("attention_bias", False)),
                q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf.get("kv_lora_rank", 512), qk_nope_head_dim=nope,
                qk_rope_head_dim=rope_dim, v_head_dim=hf.get("v_head_dim", 128),
                rope_interleave=bool(hf.get("rope_interleave", True)) if model_type == "deepseek_v3" else True)
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) == "yarn":
        keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attention_factor", "truncate")
        args["rope_yarn"] = {k: rope[k] for k in keys if rope.get(k) is not None}
    if model_type == "glm_moe_dsa":
        types = hf.get("indexer_types")
        if types is None:
            raise UnsupportedCheckpointError("glm_moe_dsa config.json without indexer_types (write it with "
                                             "transformers >= 5.24, which derives it from index_topk_freq)")
        args.update(index_n_heads=hf.get("index_n_heads", 32), index_head_dim=hf.get("index_head_dim", 128),
                    index_topk=hf.get("index_topk", 2048), indexer_types=tuple(types))
    return args
