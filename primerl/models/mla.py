"""Multi-head latent attention (DeepSeek-V3 / Kimi-K2, GLM-5) and DeepSeek sparse attention's
lightning indexer (GLM-5), over packed sequences.

Shape legend: T tokens, D model dim, H heads, Rq ``q_lora_rank``, R ``kv_lora_rank`` (512),
Dn ``qk_nope_head_dim``, Dr ``qk_rope_head_dim`` (64), Dv ``v_head_dim``, Dqk = Dn + Dr,
Hi / Di indexer heads / head dim, K ``index_topk``.

MLA (parameter names are Hugging Face's, so checkpoints map one to one)::

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))          [T, H, Dqk]   (or q_proj(x))
    c, kr  = split(kv_a_proj_with_mqa(x), [R, Dr])         c: the latent, kr: one shared rope key
    c      = kv_a_layernorm(c)
    k_nope, v = split(kv_b_proj(c), [Dn, Dv]) per head
    k      = [k_nope, rope(kr)]  q = [q_nope, rope(q_rope)]

The rope part is rotated in DeepSeek's interleaved-pair convention (``rope_interleave``; GLM-5
always), with the output in rotate-half layout, as Hugging Face does (q and k get the same
permutation, so scores are unchanged).

Dense form (training, and every layer of a deepseek_v3 model): per-head keys and values, attention
with Dqk != Dv through :func:`primerl.kernels.attention.mla.mla_attention`.

Sparse form (glm_moe_dsa when a sequence is longer than ``index_topk``): the indexer picks K keys
per query; attention runs in the absorbed form over the shared latent (one kv head: keys
``[c, rope(kr)]`` of width R + Dr, values ``c``), with ``q_abs = q_nope @ W_uk`` and the output
``o_lat @ W_uv`` (W_uk / W_uv the two halves of ``kv_b_proj``), in
:func:`primerl.kernels.sparse_attention.sparse_attention`. Every query attends at least to
itself; a query with at most K visible keys selects all of them, so short sequences get exactly
dense attention (which is why a batch whose sequences all fit in K takes the dense form).

Context parallelism (a ``ContextShardPlan`` instead of ``cu_seqlens``): the dense form runs ring
attention (V zero-padded to Dqk). In the sparse form a query may select a key held by any rank:
every rank all-gathers the latent KV (R + Dr values per token, 576 for GLM-5: the point of MLA)
and the indexer keys (Di per token), selects against all of them in the plan's padded global
order, and attends locally; the gather's backward sums each key's gradient over ranks back to
its owner. Memory per rank: T x (R + Dr + Di) values, not T x H x (Dqk + Dv). Under Ulysses
(``primerl.parallel.ulysses``) the dense form all-to-alls q/k/v by head, and the sparse form the
absorbed queries (the latent KV is gathered as above; the top-k rows are all-gathered over the
Ulysses group), so each rank attends all of its group's tokens for H / U heads.

The indexer's training: kept frozen. Hugging Face's ``GlmMoeDsaIndexer`` runs under
``torch.no_grad`` and GLM-5's checkpoints ship a trained indexer; the RL loss has no path to it (a
top-k is a discrete choice). DeepSeek-V3.2 trains its indexer with a separate KL term (to the main
attention's distribution, over the selected keys in its sparse stage, the indexer's input
detached) during pre-training; in RL that term would move the selection between the sampler's
and the trainer's forward passes, adding trainer/inference mismatch for no reward signal. So the
selection is computed without gradient and the indexer's weights get none (``requires_grad`` is
off; they are loaded, saved and sharded like any other). The cost shows on a model trained from
scratch: a random frozen indexer may never offer a query the key it needs
(``examples/reverse_text_glm5.toml`` plateaus at reward 0.40 with top-4, 0.73 with every key).
Router replay is unaffected: it concerns the MoE layers only.

Top-k ties: relu makes exact zero index scores common; among equal scores the earlier key wins
(a stable sort, :mod:`primerl.kernels.sparse_attention.reference`), so the packed, context-parallel
and engine layouts select the same keys. Hugging Face's ``torch.topk`` breaks such ties its own
way: at an exact tie on the top-k boundary the two may attend to different keys.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import MoETransformerConfig
from .layers import RMSNorm, rope_cos_sin

_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: Hugging Face builds them with the default eps


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, yarn: dict, device=None) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv:2309.00071) inverse frequencies ``[dim / 2]`` and the cos/sin factor: frequencies
    blend from extrapolated (fast dims) to interpolated by ``factor`` (slow dims) over the dims
    whose rotation count at the original context lies between beta_fast and beta_slow."""
    factor, orig = float(yarn["factor"]), yarn["original_max_position_embeddings"]
    mscale, mscale_all = yarn.get("mscale"), yarn.get("mscale_all_dim")
    attn_factor = yarn.get("attention_factor")
    if attn_factor is None:
        attn_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                       else _yarn_mscale(factor))

    def dim_of(rotations):  # the dim whose wavelength fits `rotations` times in the original context
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(yarn.get("beta_fast") or 32), dim_of(yarn.get("beta_slow") or 1)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    keep = 1 - ramp  # 1: extrapolate (unchanged frequency), 0: interpolate (divided by factor)
    return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep, float(attn_factor)


def mla_rope_cos_sin(position_ids: torch.Tensor, config: MoETransformerConfig, dtype: torch.dtype):
    """cos/sin ``[T, Dr]`` of the rope part: plain RoPE, or YaRN (scaled by its attention factor)."""
    if not config.rope_yarn:
        return rope_cos_sin(position_ids, config.qk_rope_head_dim, config.rope_theta, dtype)
    inv_freq, factor = yarn_inv_freq(config.qk_rope_head_dim, config.rope_theta, config.rope_yarn, position_ids.device)
    freqs = position_ids.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def mla_softmax_scale(config: MoETransformerConfig) -> float:
    """``Dqk ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN (DeepSeek's rule)."""
    scale = config.head_dim ** -0.5
    yarn = config.rope_yarn
    if yarn and yarn.get("mscale_all_dim"):
        scale *= _yarn_mscale(float(yarn["factor"]), yarn["mscale_all_dim"]) ** 2
    return scale


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate all of ``x[T, H, Dr]`` (cos/sin ``[T, Dr]`` from :func:`rope_cos_sin`).

    ``interleave``: pairs ``(x0, x1), (x2, x3), ...`` rotated by one frequency each, written back as
    ``[evens', odds']`` (Hugging Face's ``apply_rotary_pos_emb_interleave``); else rotate-half.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]
    if interleave:
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class IndexerState:
    """The top-k selections one forward passes from the "full" indexer layers to the "shared" layers
    after them, keyed by the full layer's index: under activation checkpointing blocks are
    recomputed in reverse order, and a shared layer must then still read its own source layer's
    selection, not the last one written. A plain object, not a dict: FSDP2's pre-forward hook
    rebuilds dict / list / dataclass arguments when it casts their tensors, which would drop what a
    layer writes into them."""

    __slots__ = ("indices", "longest")

    def __init__(self):
        # layer id -> [T, K] int32 (training: rows of the batch; engine decode: rows of the
        # flattened latent cache)
        self.indices: dict[int, torch.Tensor] = {}
        # the batch's longest sequence: the model's max_seqlen, else read once per forward (a host sync on GPU)
        self.longest = None


def _is_context_plan(plan) -> bool:
    from primerl.parallel.context import ContextShardPlan

    return isinstance(plan, ContextShardPlan)


def _backend(config: MoETransformerConfig, supported: tuple[str, ...]):
    """The config's attention backend where the op implements it; else the op's default."""
    return config.attn_backend if config.attn_backend in supported else None


class Indexer(nn.Module):
    """DeepSeek sparse attention's lightning indexer (GLM-5 ``GlmMoeDsaIndexer``).

    ``select(x [T, D], q_latent [T, Rq], position_ids, cu_seqlens) -> indices [T, K]`` int32 rows of
    the packed batch (-1 = none), no gradient. Keys: ``LayerNorm(wk(x))`` (one head), queries
    ``wq_b(q_latent)`` with Hi heads, the first Dr dims of both rotated (interleaved), head
    weights ``weights_proj(x) / sqrt(Hi)`` (float32), score ``sum_h w_h relu(q_h . k / sqrt(Di))``.
    """

    def __init__(self, config: MoETransformerConfig):
        super().__init__()
        c = config
        self.n_heads, self.head_dim = c.index_n_heads, c.index_head_dim
        self.rope_dim, self.topk = c.qk_rope_head_dim, c.index_topk
        self.wq_b = nn.Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(c.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(c.dim, c.index_n_heads, bias=False)  # kept in float32 (as Hugging Face)
        self.config = c
        for p in self.parameters():  # frozen (see the module docstring)
            p.requires_grad_(False)

    @torch.no_grad()
    def project(self, x, q_latent, cos, sin):
        """-> q ``[T, Hi, Di]``, k ``[T, Di]``, weights ``[T, Hi]`` float32 (the indexer op's inputs)."""
        T, r = x.shape[0], self.rope_dim
        q = self.wq_b(q_latent).view(T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))[:, None, :]
        q = torch.cat((rope_pairs(q[..., :r], cos, sin, True), q[..., r:]), dim=-1)
        k = torch.cat((rope_pairs(k[..., :r], cos, sin, True), k[..., r:]), dim=-1)[:, 0]
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        return q, k, w

    @torch.no_grad()
    def select(self, x, q_latent, cos, sin, cu_seqlens, max_seqlen: int | None = None) -> torch.Tensor:
        """Indices into this batch's tokens (``cu_seqlens`` a tensor; ``max_seqlen`` its longest
        sequence, for the Triton indexer's grids) or, under context parallelism (a
        ``ContextShardPlan``), into every rank's tokens gathered in the plan's padded order."""
        from primerl.kernels.sparse_attention import indexer_topk

        q, k, w = self.project(x, q_latent, cos, sin)
        kw = dict(topk=self.topk, softmax_scale=self.head_dim ** -0.5,
                  backend=_backend(self.config, ("torch", "triton")))
        if torch.is_tensor(cu_seqlens):
            return indexer_topk(q, k.to(q.dtype), w, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **kw)
        from primerl.parallel.context import gather_shards, padded_key_positions

        plan = cu_seqlens
        return indexer_topk(q, gather_shards(k, plan).to(q.dtype), w, cu_seqlens=plan.local_cu_seqlens,
                            cu_seqlens_k=plan.padded_cu_seqlens, q_positions=plan.positions,
                            k_positions=padded_key_positions(plan), **kw)


class MLAttention(nn.Module):
    """Multi-head latent attention over packed sequences (see the module docstring).

    ``forward(x [T, D], position_ids [T], cu_seqlens, state=None) -> [T, D]``. ``state`` is the
    :class:`IndexerState` the model passes through its layers: a ``"shared"`` indexer layer (GLM-5
    ``indexer_types``) reads the selection of the nearest full layer before it.
    """

    def __init__(self, config: MoETransformerConfig, layer_id: int = 0):
        super().__init__()
        c = config
        self.n_heads, self.kv_lora_rank, self.v_head_dim = c.n_heads, c.kv_lora_rank, c.v_head_dim
        self.nope_dim, self.rope_dim, self.head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.head_dim
        self.rope_theta, self.rope_interleave = c.rope_theta, c.rope_interleave
        self.softmax_scale = mla_softmax_scale(c)
        H, bias = c.n_heads, c.attention_bias
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.dim, H * c.head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.dim, c.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * c.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * c.v_head_dim, c.dim, bias=c.o_proj_bias)
        self.sparse = c.is_sparse
        self.layer_id = layer_id
        self.shares_indices = self.sparse and c.indexer_types[layer_id] == "shared"
        # the layer whose selection this one uses: itself, or the nearest full layer before it
        self.index_source = max(i for i in range(layer_id + 1) if c.indexer_types[i] == "full") if self.sparse \
            else layer_id
        self.indexer = Indexer(c) if self.sparse and not self.shares_indices else None
        # Set by parallelize() for context parallelism: fn(q, k, v, plan, *, causal, softmax_scale, backend).
        self.context_attention = None
        self.config = c

    # ----------------------------------------------------------------------------------------------
    def project_latent(self, x: torch.Tensor, position_ids: torch.Tensor):
        """-> q_nope ``[T, H, Dn]``, q_rope ``[T, H, Dr]`` (rotated), latent c ``[T, R]`` (normed),
        k_rope ``[T, Dr]`` (rotated), q_latent ``[T, Rq]`` (None without q_lora_rank), cos, sin.
        The inputs of every form (dense, sparse, and an engine's latent KV cache of R + Dr per token)."""
        T = x.shape[0]
        if hasattr(self, "q_proj"):
            q_latent = None
            q = self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        q = q.view(T, self.n_heads, self.head_dim)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        cos, sin = mla_rope_cos_sin(position_ids, self.config, q.dtype)
        q_rope = rope_pairs(q[..., self.nope_dim:], cos, sin, self.rope_interleave)
        k_rope = rope_pairs(k_rope[:, None, :], cos, sin, self.rope_interleave)[:, 0]
        return q[..., :self.nope_dim], q_rope, c, k_rope, q_latent, cos, sin

    def _kv_b_halves(self):
        """W_uk ``[H, Dn, R]`` and W_uv ``[H, Dv, R]`` from kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def _dense(self, q_nope, q_rope, c, k_rope, cu_seqlens, max_seqlen: int | None = None):
        T, H = q_nope.shape[:2]
        k_nope, v = self.kv_b_proj(c).view(T, H, self.nope_dim + self.v_head_dim).split(
            [self.nope_dim, self.v_head_dim], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope[:, None, :].expand(T, H, self.rope_dim)), dim=-1)
        backend = self.config.attn_backend
        if self.context_attention is not None and not torch.is_tensor(cu_seqlens):
            from primerl.kernels.attention.mla import pad_for_square

            qp, kp, vp, dv = pad_for_square(q, k, v)
            return self.context_attention(qp, kp, vp, cu_seqlens, causal=True, softmax_scale=self.softmax_scale,
                                          backend=backend)[..., :dv]
        from primerl.kernels.attention.mla import mla_attention

        return mla_attention(q, k, v, cu_seqlens=cu_seqlens.to(torch.int32), causal=True,
                             softmax_scale=self.softmax_scale, backend=backend, max_seqlen=max_seqlen)

    def _sparse(self, q_nope, q_rope, kv, indices, head_parallel: bool = False):
        """kv ``[Tk, R + Dr]`` the latent keys (its first R columns are the values), indices ``[T, K]`` rows of kv.
        ``head_parallel``: the context attention's own sparse form (Ulysses: queries all-to-all'd by head)."""
        from primerl.kernels.sparse_attention import sparse_attention

        w_uk, w_uv = self._kv_b_halves()
        q_abs = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        q = torch.cat((q_abs, q_rope), dim=-1)  # [T, H, R + Dr]
        kv = kv[:, None, :]  # one latent head shared by all heads
        attend = self.context_attention.sparse_attention if head_parallel else sparse_attention
        o_lat = attend(q, kv, kv[..., :self.kv_lora_rank], indices, softmax_scale=self.softmax_scale,
                       backend=_backend(self.config, ("torch", "triton")))
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens,
                state: IndexerState | None = None) -> torch.Tensor:
        q_nope, q_rope, c, k_rope, q_latent, cos, sin = self.project_latent(x, position_ids)
        o = None
        if self.sparse:
            cu = cu_seqlens if torch.is_tensor(cu_seqlens) else cu_seqlens.cu_seqlens  # global lengths under CP
            if not torch.is_tensor(cu_seqlens) and not _is_context_plan(cu_seqlens):
                cu_seqlens = cu  # another plan over the whole batch (the trainer's PaddedPlan): sparse runs on cu
            if state is not None and state.longest is not None:
                longest = state.longest
            else:
                longest = int((cu[1:] - cu[:-1]).max())
            if state is not None:
                state.longest = longest
            if longest > self.config.index_topk:  # else every query keeps all its keys: dense
                if self.shares_indices:
                    if state is None or self.index_source not in state.indices:
                        raise ValueError(f"'shared' indexer layer {self.layer_id} needs layer {self.index_source}'s "
                                         f"selection (the model's IndexerState)")
                    indices = state.indices[self.index_source]
                else:
                    indices = self.indexer.select(x, q_latent, cos, sin, cu_seqlens, max_seqlen=longest)
                    if state is not None:
                        state.indices[self.layer_id] = indices
                kv = torch.cat((c, k_rope), dim=-1)
                if not torch.is_tensor(cu_seqlens):
                    # Context parallelism: a query may select a key of any rank, so every rank gathers
                    # the whole latent KV (R + Dr per token: MLA's small cache) and the indexer keys
                    # (Di per token); the gather's backward sums the key gradients back to their owners.
                    from primerl.parallel.context import gather_shards

                    kv = gather_shards(kv, cu_seqlens)
                if not torch.is_tensor(cu_seqlens) and hasattr(self.context_attention, "sparse_attention"):
                    o = self._sparse(q_nope, q_rope, kv, indices, head_parallel=True)
                else:
                    o = self._sparse(q_nope, q_rope, kv, indices)
        if o is None:
            o = self._dense(q_nope, q_rope, c, k_rope, cu_seqlens, None if state is None else state.longest)
        return self.o_proj(o.reshape(x.shape[0], self.n_heads * self.v_head_dim))

    # ----------------------------------------------------------------------------------------------
    # Decode in the absorbed form (an inference engine's KV cache of latents)
    def cache_width(self) -> int:
        """Values cached per token: the latent c (R) and the rotated rope key (Dr), plus the indexer's
        key (Di) in a sparse model (every layer gets the same width)."""
        c = self.config
        return c.kv_lora_rank + c.qk_rope_head_dim + (c.index_head_dim if c.is_sparse else 0)

    def attend_cached(self, x: torch.Tensor, position_ids: torch.Tensor, cache: torch.Tensor, slot: torch.Tensor,
                      state: IndexerState) -> torch.Tensor:
        """One engine step of new tokens over the latent cache, in the absorbed form.

        x ``[T, D]`` new tokens (rows of several requests), position_ids ``[T]``, slot ``[T]`` the
        request's cache row, cache ``[B, S_max, W]`` (``W = cache_width()``; this layer's, written
        here at ``[slot, position]``). Scores ``q_abs . c + q_rope . k_rope`` with ``q_abs = q_nope
        @ W_uk``; output ``softmax @ c`` then ``@ W_uv`` and o_proj -> ``[T, D]``. In a sparse model
        whose request is longer than ``index_topk``, each query attends to its indexer top-k only,
        through :func:`primerl.kernels.sparse_attention.sparse_attention` over the flattened cache
        (``state`` carries the selection to "shared" layers, as in training).
        """
        from primerl.kernels.sparse_attention.reference import topk_from_scores

        R, Dr = self.kv_lora_rank, self.rope_dim
        q_nope, q_rope, c, k_rope, q_latent, cos, sin = self.project_latent(x, position_ids)
        pos = position_ids.long()
        cache[slot, pos, :R + Dr] = torch.cat((c, k_rope), dim=-1).to(cache.dtype)
        if self.indexer is not None:
            _, k_idx, _ = self.indexer.project(x, q_latent, cos, sin)
            cache[slot, pos, R + Dr:] = k_idx.to(cache.dtype)
        S = int(pos.max()) + 1
        w_uk, w_uv = self._kv_b_halves()
        q_abs = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        visible = torch.arange(S, device=x.device)[None, :] <= pos[:, None]  # [T, S]
        if self.sparse and S > self.config.index_topk:
            # the trainer's sparse form over the cache: the indexer's top-k rows of the flattened
            # cache, gathered by the sparse-attention kernel (no [T, S] attention is formed)
            if self.shares_indices:
                indices = state.indices[self.index_source]
            else:
                q_i, _, w = self.indexer.project(x, q_latent, cos, sin)
                s_i = torch.relu(torch.einsum("thd,tsd->ths", q_i.float(), cache[slot, :S, R + Dr:].float())
                                 * self.indexer.head_dim ** -0.5)
                score = torch.einsum("th,ths->ts", w, s_i).masked_fill(~visible, float("-inf"))
                local = topk_from_scores(score, self.config.index_topk, torch.zeros_like(pos))
                indices = torch.where(local >= 0, local + (slot * cache.shape[1])[:, None].to(local.dtype), -1)
                state.indices[self.layer_id] = indices
            flat = cache.view(-1, cache.shape[-1])[:, None, :]  # [B * S_max, 1, W]
            from primerl.kernels.sparse_attention import sparse_attention

            o_lat = sparse_attention(torch.cat((q_abs, q_rope), dim=-1).to(cache.dtype), flat[..., :R + Dr],
                                     flat[..., :R], indices.to(torch.int32), softmax_scale=self.softmax_scale,
                                     backend=_backend(self.config, ("torch", "triton"))).to(x.dtype)
        else:
            rows = cache[slot, :S]  # [T, S, W]
            s = (torch.einsum("thr,tsr->ths", q_abs.float(), rows[..., :R].float())
                 + torch.einsum("thd,tsd->ths", q_rope.float(), rows[..., R:R + Dr].float())) * self.softmax_scale
            p = torch.softmax(s.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
            o_lat = torch.einsum("ths,tsr->thr", p, rows[..., :R].float()).to(x.dtype)
        o = torch.einsum("thr,hvr->thv", o_lat, w_uv)
        return self.o_proj(o.reshape(x.shape[0], self.n_heads * self.v_head_dim))
