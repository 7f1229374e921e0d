"""MoETransformer: a decoder-only MoE language model over packed sequences.

Structure (for an inference engine that runs the pieces itself, e.g. with a KV cache)::

    model.embed                      nn.Embedding(V, D)
    model.layers[i].attention_norm   RMSNorm(D)
    model.layers[i].attention        Attention: project_qkv(x, pos) -> q, k, v ; o_proj
    model.layers[i].ffn_norm         RMSNorm(D)
    model.layers[i].ffn              primerl.models.moe.MoE  (layer.is_moe)  or  DenseMLP
    model.norm                       RMSNorm(D)
    model.lm_head                    nn.Linear(D, V)  (its weight is embed.weight when tied)

Shape legend: T tokens of a packed batch, B sequences, D model dim, V vocabulary, L MoE layers,
k experts per token.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from primerl.kernels import check_values

from .config import MoETransformerConfig
from .layers import Attention, DenseMLP, RMSNorm


def build_moe(config: MoETransformerConfig) -> nn.Module:
    from .moe import MoE

    c = config
    return MoE(c.dim, c.moe_dim, c.num_experts, c.top_k, num_shared_experts=c.num_shared_experts,
               score_func=c.score_func, route_norm=c.route_norm, route_scale=c.route_scale, n_groups=c.n_groups,
               topk_groups=c.topk_groups, use_expert_bias=c.use_expert_bias)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h + attn(norm(h))`` then ``h + ffn(norm(h))``."""

    def __init__(self, config: MoETransformerConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.is_moe = layer_id not in config.dense_layers
        self.attention_norm = RMSNorm(config.dim, config.rms_norm_eps)
        if config.is_mla:
            from .mla import MLAttention

            self.attention = MLAttention(config, layer_id)
        else:
            self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.rms_norm_eps)
        self.ffn = build_moe(config) if self.is_moe else DenseMLP(config.dim, config.ffn_dim)

    def forward(self, h: torch.Tensor, position_ids: torch.Tensor, cu_seqlens, replay_ids=None,
                attn_state=None) -> torch.Tensor:
        if attn_state is None:
            h = h + self.attention(self.attention_norm(h), position_ids, cu_seqlens)
        else:  # MLA with a sparse-attention indexer: layers may share the previous layer's selection
            h = h + self.attention(self.attention_norm(h), position_ids, cu_seqlens, attn_state)
        x = self.ffn_norm(h)
        return h + (self.ffn(x, replay_ids=replay_ids) if self.is_moe else self.ffn(x))


class MoETransformer(nn.Module):
    """Decoder-only MoE transformer (Qwen3-MoE, GLM-4.5-MoE, DeepSeek-V3 / Kimi-K2 and GLM-5 families:
    the last two with multi-head latent attention, GLM-5 with DeepSeek sparse attention; see
    ``primerl/models/mla.py``) over packed sequences.

    Example::

        cfg = MoETransformerConfig.tiny(vocab_size=100)
        model = MoETransformer(cfg)
        ids = torch.randint(0, 100, (7,))
        pos = torch.tensor([0, 1, 2, 0, 1, 2, 3])
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        logits = model(ids, pos, cu, return_logits=True)   # [7, 100]
        ids_TLK = model.routing()                           # [7, L, k] uint8
        same = model(ids, pos, cu, replay_ids=ids_TLK, return_logits=True)
    """

    def __init__(self, config: MoETransformerConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self._expert_format = "unfused"  # the layout save_pretrained writes (from_pretrained keeps the source's)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    # ----------------------------------------------------------------------------------------------
    @property
    def moe_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.layers if layer.is_moe]

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, initializer_range) for matrices, ones for norms, zeros for biases and buffers."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.ndim == 1:
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
        for _, b in self.named_buffers():
            if b.is_floating_point():
                b.zero_()

    # ----------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens, *,
                replay_ids: torch.Tensor | None = None, return_logits: bool = False,
                max_seqlen: int | None = None) -> torch.Tensor:
        """Run the packed batch.

        Args:
            input_ids: ``[T]`` token ids of all sequences concatenated.
            position_ids: ``[T]`` position of each token within its sequence.
            cu_seqlens: int32 ``[B+1]`` sequence boundaries (flash-attn's varlen convention), or, after
                :func:`parallelize` with context parallelism, the batch's ``ContextShardPlan`` with the
                token tensors already sharded by it.
            replay_ids: optional ``[T, L, k]`` expert ids (any integer dtype) to replay instead of routing.
            return_logits: return ``[T, V]`` logits instead of the final hidden states ``[T, D]``.
            max_seqlen: the longest sequence of ``cu_seqlens`` (flash-attn style), from where the batch
                is built. A sparse-attention model (glm_moe_dsa) picks its dense or sparse form by it:
                given, the forward reads nothing on the host; else it reads ``cu_seqlens`` once per
                forward (a GPU sync). Checked on the device (no host read outside debug mode).
        """
        self._validate(input_ids, position_ids, cu_seqlens, replay_ids)
        if max_seqlen is not None:
            if not (isinstance(max_seqlen, int) and max_seqlen >= 0):
                raise ValueError(f"max_seqlen must be a non-negative int (the longest sequence), got {max_seqlen!r}")
            if torch.is_tensor(cu_seqlens):
                check_values(cu_seqlens.diff().max() == max_seqlen,
                             "max_seqlen must equal the longest sequence of cu_seqlens",
                             lambda: f"max_seqlen={max_seqlen}, cu_seqlens {cu_seqlens.tolist()}")
        h = self.embed(input_ids)
        j = 0
        state = None
        if self.config.is_sparse:
            from .mla import IndexerState

            state = IndexerState()
            state.longest = max_seqlen
        for layer in self.layers:
            extra = {} if state is None else {"attn_state": state}
            if layer.is_moe:
                rid = None if replay_ids is None else replay_ids[:, j].to(torch.int64)
                j += 1
                h = layer(h, position_ids, cu_seqlens, replay_ids=rid, **extra)
            else:
                h = layer(h, position_ids, cu_seqlens, **extra)
        h = self.norm(h)
        return self.lm_head(h) if return_logits else h

    def _validate(self, input_ids, position_ids, cu_seqlens, replay_ids) -> None:
        if input_ids.ndim != 1 or input_ids.dtype.is_floating_point or input_ids.is_complex():
            raise ValueError(f"input_ids must be a 1-D integer tensor [T], got shape {tuple(input_ids.shape)} "
                             f"dtype {input_ids.dtype}")
        T = input_ids.shape[0]
        if position_ids.shape != (T,):
            raise ValueError(f"position_ids must have shape [T]=({T},), got {tuple(position_ids.shape)}")
        if torch.is_tensor(cu_seqlens):
            if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"cu_seqlens must be an int32 tensor [B+1] with B >= 1, got shape "
                                 f"{tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}")
            ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == T) & (cu_seqlens.diff() >= 0).all()
            check_values(ok, "cu_seqlens must be non-decreasing from 0 to T (the number of tokens)",
                         lambda: f"T={T}, got {cu_seqlens.tolist()}")
        elif cu_seqlens is None or not hasattr(cu_seqlens, "shard"):
            raise ValueError(f"cu_seqlens must be an int32 tensor [B+1] or a ContextShardPlan, got {type(cu_seqlens)}")
        self._validate_values(input_ids, position_ids, cu_seqlens if torch.is_tensor(cu_seqlens) else None)
        if replay_ids is not None:
            L, k = len(self.config.moe_layer_ids), self.config.top_k
            if replay_ids.shape != (T, L, k):
                raise ValueError(f"replay_ids must have shape [T, L, k]=({T}, {L}, {k}), got {tuple(replay_ids.shape)}")
            if replay_ids.dtype.is_floating_point:
                raise ValueError(f"replay_ids must be an integer tensor, got {replay_ids.dtype}")

    def _validate_values(self, input_ids, position_ids, cu_seqlens) -> None:
        """Token ids in [0, vocab_size), and (with a tensor ``cu_seqlens``) position t of a sequence
        equal to t: positions that contradict the boundaries would silently shift RoPE.

        Costs O(T) elementwise work on the device and no host read
        (:func:`primerl.kernels.check_values`; in debug mode a read and a detailed ValueError). Under context
        parallelism (a ``ContextShardPlan``) or the trainer's padded path the positions come from
        the packer and are not re-checked."""
        V, T = self.config.vocab_size, input_ids.shape[0]
        if T == 0:
            return
        check_values(((input_ids >= 0) & (input_ids < V)).all(), "input_ids must be in [0, vocab_size)",
                     lambda: f"vocab_size={V}, got values in [{int(input_ids.min())}, {int(input_ids.max())}]")
        if cu_seqlens is not None:
            from primerl.kernels.attention.reference import default_positions

            cu = cu_seqlens.to(position_ids.device)
            expected = default_positions(cu, cu, T, T)[0].long()

            def detail():
                i = int((position_ids.long() != expected).nonzero()[0])
                return (f"cu_seqlens {cu_seqlens.tolist()}; index {i} has {int(position_ids[i])}, "
                        f"expected {int(expected[i])}")

            check_values((position_ids.long() == expected).all(),
                         "position_ids contradict cu_seqlens: positions must restart at 0 at every sequence start "
                         "and count up by 1", detail)

    def routing(self) -> torch.Tensor:
        """Top-k expert ids of the last forward, ``[T, L, k]`` in the smallest unsigned dtype that holds
        them (uint8 for <= 256 experts)."""
        records = []
        for layer in self.moe_layers:
            r = layer.ffn.routing
            if r is None:
                raise RuntimeError("routing() needs a forward first: no routing was recorded")
            records.append(r)
        if not records:
            raise RuntimeError("routing(): the model has no MoE layer")
        dtype = self.config.routing_dtype()
        return torch.stack([r.to(torch.int64) for r in records], dim=1).to(dtype)

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                        device: torch.device | str = "cpu") -> "MoETransformer":
        """Load a local Hugging Face checkpoint directory (config.json + safetensors), streaming."""
        from .checkpoint import load_pretrained

        return load_pretrained(cls, path, dtype=dtype, device=device)

    def save_pretrained(self, path: str | os.PathLike, *, expert_format: str | None = None,
                        max_shard_size: int = 5 * 2**30) -> None:
        """Write config.json + safetensors in Hugging Face's layout (``expert_format`` "unfused" per-expert
        tensors or "fused" ``gate_up_proj``/``down_proj``; default: the layout it was loaded from)."""
        from .checkpoint import save_pretrained

        save_pretrained(self, path, expert_format=expert_format, max_shard_size=max_shard_size)
