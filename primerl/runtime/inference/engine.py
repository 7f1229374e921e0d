"""Embedded inference engine: continuous batching with a KV cache on ``primerl.models.MoETransformer``.

Every ``step()`` runs ONE forward over a packed set of tokens: the whole prompt of each newly
admitted request (prefill) and the last sampled token of each running request (decode), so
requests of any length join and leave the batch independently (continuous batching). Each
token's key/value go into a per-slot cache ``[slots, capacity, Hkv, Dh]`` per layer, and each
query attends to its own slot's cache up to its position.

Sampling: temperature, then top-p over the sorted distribution, by inverse CDF with one uniform
per token from the request's own ``random.Random(seed)``, so a request's tokens do not depend on
what else is in the batch. The log-prob returned per token is ``log_softmax(logits / T)`` of the
sampled token (before top-p truncation), the quantity the trainer recomputes.

Router capture: for every position a request feeds through the model (prompt positions and each
generated token that was fed back), the ``[L, k]`` expert ids used there; the result is
``[prompt_len + generated - 1, L, k]`` (the last sampled token is never fed back).

``kv_cache=False`` recomputes every request's whole prefix with ``model.forward`` each step: the
slow reference the cached path is tested against.

Device: the engine runs where the model's parameters are (CPU or one GPU). The KV cache,
logits, sampling (the request's uniforms are drawn on the host and copied in) and router
capture stay on that device; one step reads back ONE small tensor (the sampled ids, their
log-probs and a finite flag, plus the step's routing when captured), the host sync continuous
batching needs to decide which requests stop. ``kv_cache_gb`` caps the cache (it is allocated
lazily, doubling its capacity as sequences grow; an allocation beyond the cap raises).

Shape legend: T tokens in a step, S cache capacity, H/Hkv heads, Dh head dim, L MoE layers, k top-k.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


class EngineError(RuntimeError):
    pass


class EngineTimeout(EngineError, TimeoutError):
    pass


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0


@dataclass
class Prefilled:
    """A prompt's KV cache computed by a prefill server (``primerl.runtime.inference.pd``).

    k, v: [L, P, Hkv, Dh] (MLA: k [L, P, W] latent rows, v [L, P, 0]) in the model's dtype;
    first_token / first_logprob: the token the prefill server sampled after the prompt (with the
    request's first uniform); routing: [P, L, k] the prompt positions' routed experts, or None."""

    k: torch.Tensor
    v: torch.Tensor
    first_token: int
    first_logprob: float
    routing: torch.Tensor | None
    policy_version: int
    first_time: float = 0.0  # time.monotonic() on the prefill server when the first token was sampled


@dataclass
class Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    prefilled: Prefilled | None = None  # decode role: continue from a handed-over cache
    export_kv: bool = False  # prefill role: return the prompt's cache in Completion.kv


@dataclass
class Completion:
    request_id: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    routing: torch.Tensor | None  # [len(prompt) + len(tokens) - 1, L, k] uint8, or None
    finish_reason: str  # "length" or "stop"
    policy_version: int  # version when the request started (its oldest token)
    policy_version_end: int
    server: str = ""  # who sampled it: "embedded" or the server's URL (set by the client)
    kv: tuple[torch.Tensor, torch.Tensor] | None = None  # Request.export_kv: (k, v) [L, fed, ...] of its slot
    token_times: list = field(default_factory=list)  # time.monotonic() when each token was sampled (latency benches)


class _Active:
    __slots__ = ("req", "slot", "tokens", "logprobs", "routing", "rng", "version", "fed", "times")

    def __init__(self, req: Request, slot: int, version: int):
        self.req, self.slot, self.version = req, slot, version
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.routing: list[torch.Tensor] = []
        self.rng = random.Random(req.params.seed)
        self.fed = 0  # positions already in the cache
        self.times: list[float] = []


class NonFiniteLogitsError(RuntimeError):
    """The policy produced NaN/inf logits (its weights are almost certainly non-finite)."""


def _host_column(values: list[float], device: torch.device) -> torch.Tensor:
    """[B, 1] float32 on ``device`` from host numbers (an asynchronous copy: no wait on the device)."""
    return torch.tensor(values, dtype=torch.float32)[:, None].to(device, non_blocking=True)


def sample_on_device(logits_BV: torch.Tensor, temperature: list[float], top_p: list[float], uniforms: list[float]):
    """Inverse-CDF sampling per row, without any host sync: -> (token ids [B] int64, log-probs [B]
    float32, finite [B] bool: whether the row's logits were all finite), all on the logits' device.
    A row that is not finite yields garbage; the caller must check ``finite`` before using it."""
    dev = logits_BV.device
    finite = torch.isfinite(logits_BV).all(dim=-1)
    logits = logits_BV.float() / _host_column(temperature, dev)
    logp = torch.log_softmax(logits, dim=-1)
    probs_sorted, idx_sorted = logp.exp().sort(dim=-1, descending=True)
    cum = probs_sorted.cumsum(-1)
    keep = (cum - probs_sorted) < _host_column(top_p, dev)  # the token that crosses top_p is kept
    probs_sorted = probs_sorted * keep
    cdf = probs_sorted.cumsum(-1)
    u = _host_column(uniforms, dev) * cdf[:, -1:]
    pick = torch.searchsorted(cdf, u, right=True).clamp_(max=logits.shape[-1] - 1)
    pick = torch.minimum(pick, (keep.sum(-1, keepdim=True) - 1).clamp_(min=0))
    token = idx_sorted.gather(-1, pick).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1), finite


def _non_finite_error(finite_rows: list[bool]) -> NonFiniteLogitsError:
    rows = [i for i, ok in enumerate(finite_rows) if not ok]
    return NonFiniteLogitsError(f"sample_next: the logits of {len(rows)} of {len(finite_rows)} rows are not finite "
                                f"(NaN/inf; rows {rows[:8]}): the sampler's policy weights are probably non-finite")


def sample_next(logits_BV: torch.Tensor, temperature: list[float], top_p: list[float], uniforms: list[float]):
    """Inverse-CDF sampling per row: -> (token ids [B] int64, log-probs [B] float32).

    Raises NonFiniteLogitsError on a row with NaN/inf logits (there is no distribution to sample)."""
    token, logp, finite = sample_on_device(logits_BV, temperature, top_p, uniforms)
    if not bool(finite.all()):
        raise _non_finite_error(finite.tolist())
    return token, logp


class InferenceEngine:
    """Batched generation on a MoETransformer (CPU or one GPU).

    >>> engine = InferenceEngine(model, max_batch_size=64)
    >>> outs = engine.generate([Request(0, [1, 5, 6, 2], SamplingParams(max_new_tokens=4, seed=1))])
    >>> outs[0].tokens, outs[0].logprobs, outs[0].routing.shape   # [.], [.], [4 + 4 - 1, L, k]
    """

    def __init__(self, model, *, max_batch_size: int = 64, kv_cache: bool = True, capture_routing: bool = True,
                 fp8_experts: bool = False, router_noise: float = 0.0, noise_seed: int = 0, kv_cache_gb: float = 0.0):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if not kv_cache_gb >= 0:
            raise ValueError(f"kv_cache_gb must be >= 0 (0: no cap), got {kv_cache_gb}")
        self.kv_cache_gb = kv_cache_gb
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.cfg = model.config
        self.max_batch_size, self.kv_cache, self.capture_routing = max_batch_size, kv_cache, capture_routing
        self.fp8_experts, self.router_noise = fp8_experts, router_noise
        self.adapters = None  # engine_lora.EngineAdapters under trainer.lora
        self.policy_version = 0
        self.waiting: deque[Request] = deque()
        self.running: dict[int, _Active] = {}
        self.free_slots = list(range(max_batch_size))[::-1]
        self._k = self._v = None
        self._capacity = 0
        self.tokens_generated = 0
        self.device = model.embed.weight.device
        self._noise_gen = torch.Generator(device=self.device).manual_seed(noise_seed)
        self._hooks = []
        if router_noise > 0:
            self._install_router_noise()
        if fp8_experts:
            self._quantize_experts()

    # ---------------------------------------------------------------- weights
    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int, *, assign: bool = False) -> None:
        """Copy new policy weights in (in-flight requests continue with them, keeping their cache).
        ``assign``: take the tensors themselves instead of copying (fresh tensors in the engine's
        dtype and device that nobody else holds, e.g. a received version): the swap between two
        steps then costs no copy of the model. LoRA adapters in PEFT's names (a ``LoRAChannel``
        version) go to ``self.adapters`` (``engine_lora.EngineAdapters``, set up by the
        orchestrator's client under ``trainer.lora``)."""
        from .engine_lora import is_adapter_state

        if is_adapter_state(state_dict):
            if getattr(self, "adapters", None) is None:
                raise EngineError("weight update: a LoRA adapter version reached an engine without adapters "
                                  "(trainer.lora is set on the trainer only?)")
            self.adapters.load(state_dict)
            if self.fp8_experts and self.adapters.mode == "merge":
                self._quantize_experts()
            self.policy_version = int(version)
            return
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False, assign=assign)
        if missing or unexpected:
            raise EngineError(f"weight update does not match the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
        if self.fp8_experts:
            self._quantize_experts()
        self.policy_version = int(version)

    @torch.no_grad()
    def _quantize_experts(self) -> None:
        """Round every routed/shared expert weight through FP8 e4m3 with 128x128 block scales."""
        from primerl.kernels.fp8 import dequant, quant_per_block

        for name, p in self.model.named_parameters():
            if ".ffn." in name and "expert" in name and p.ndim >= 2 and p.is_floating_point() \
                    and ".lora_" not in name:  # LoRA adapters stay in the engine's dtype
                q, sf = quant_per_block(p.data, (128, 128))
                p.copy_(dequant(q, sf, group_shape=(128, 128), out_dtype=p.dtype))

    def _install_router_noise(self) -> None:
        """Gaussian noise on every router's logits (a stand-in for inference-side numerics)."""
        for layer in self.model.layers:
            if getattr(layer, "is_moe", False):
                gate = _find_router(layer.ffn)
                self._hooks.append(gate.register_forward_hook(
                    lambda m, i, out: out + self.router_noise * torch.randn(out.shape, generator=self._noise_gen,
                                                                          device=out.device, dtype=out.dtype)))

    # ---------------------------------------------------------------- requests
    def add_request(self, req: Request) -> None:
        p = req.params
        if not req.prompt:
            raise ValueError(f"request {req.request_id}: prompt is empty")
        if p.max_new_tokens < 1:
            raise ValueError(f"request {req.request_id}: max_new_tokens must be >= 1, got {p.max_new_tokens}")
        if p.temperature <= 0 or not 0 < p.top_p <= 1:
            raise ValueError(f"request {req.request_id}: need temperature > 0 and top_p in (0, 1], "
                             f"got {p.temperature}, {p.top_p}")
        bad = [t for t in req.prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"request {req.request_id}: prompt token ids {bad[:5]} outside [0, {self.cfg.vocab_size})")
        total = len(req.prompt) + p.max_new_tokens
        if total > self.cfg.max_position_embeddings:
            raise ValueError(f"request {req.request_id}: prompt + max_new_tokens = {total} exceeds "
                             f"max_position_embeddings = {self.cfg.max_position_embeddings}")
        if req.prefilled is not None:
            self.check_prefilled(req.request_id, len(req.prompt), req.prefilled)
        self.waiting.append(req)

    def kv_row_shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The per-layer, per-position shapes of this model's (k, v) cache rows: ([Hkv, Dh], [Hkv, Dh]),
        or for MLA ([W], [0])."""
        c = self.cfg
        if getattr(c, "is_mla", False):
            return (self.model.layers[0].attention.cache_width(),), (0,)
        return (c.n_kv_heads, c.head_dim), (c.n_kv_heads, c.head_dim)

    def check_prefilled(self, request_id, prompt_len: int, pf: Prefilled) -> None:
        """Raise ValueError naming the mismatch when a handed-over cache does not fit this model."""
        kr, vr = self.kv_row_shape()
        want_k, want_v = (self.cfg.n_layers, prompt_len, *kr), (self.cfg.n_layers, prompt_len, *vr)
        dtype = self.model.embed.weight.dtype
        for name, t, want in (("k", pf.k, want_k), ("v", pf.v, want_v)):
            if tuple(t.shape) != want or t.dtype != dtype:
                raise ValueError(f"request {request_id}: handed-over KV cache {name} has shape {tuple(t.shape)} "
                                 f"{t.dtype}, this model needs {want} {dtype} "
                                 "(layers, prompt positions, heads, head dim)")
        if not 0 <= pf.first_token < self.cfg.vocab_size:
            raise ValueError(f"request {request_id}: handed-over first token {pf.first_token} outside "
                             f"[0, {self.cfg.vocab_size})")
        if pf.routing is not None and pf.routing.shape[0] != prompt_len:
            raise ValueError(f"request {request_id}: handed-over routing covers {pf.routing.shape[0]} positions, "
                             f"the prompt has {prompt_len}")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def kv_cache_usage(self) -> float:
        """Cache positions held by running requests over the positions allocated (0 before any)."""
        total = self.max_batch_size * self._capacity
        return sum(a.fed for a in self.running.values()) / total if total else 0.0

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._k, self._v) if t is not None)

    def abort(self, request_ids) -> None:
        ids = set(request_ids)
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        for rid in [r for r in self.running if r in ids]:
            self.free_slots.append(self.running.pop(rid).slot)

    def generate(self, requests: list[Request], *, timeout: float | None = None) -> list[Completion]:
        """Run the given requests to completion (plus anything already queued); results in input order."""
        for r in requests:
            self.add_request(r)
        want = {r.request_id for r in requests}
        done: dict[int, Completion] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while want - set(done):
            for c in self.step():
                done[c.request_id] = c
            if deadline is not None and time.monotonic() > deadline:
                raise EngineTimeout(f"generation of {len(want - set(done))} request(s) "
                                    f"did not finish within {timeout} s")
        return [done[r.request_id] for r in requests]

    # ---------------------------------------------------------------- one engine step
    @torch.no_grad()
    def step(self) -> list[Completion]:
        finished = []
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            a = _Active(req, self.free_slots.pop(), self.policy_version)
            self.running[req.request_id] = a
            if req.prefilled is not None:
                done = self._admit_prefilled(a)
                if done is not None:
                    finished.append(done)
        if not self.running:
            return finished
        active = list(self.running.values())
        logits, routing = (self._forward_cached if self.kv_cache else self._forward_full)(active)
        tokens, logps, finite = sample_on_device(logits, [a.req.params.temperature for a in active],
                                                 [a.req.params.top_p for a in active], [a.rng.random() for a in active])
        # the step's one read-back: ids (exact in float64), log-probs and the finite flags together
        host = torch.cat([tokens.double(), logps.double(), finite.double()]).tolist()
        B = len(active)
        if not all(host[2 * B:]):
            raise NonFiniteLogitsError(f"{_non_finite_error([bool(x) for x in host[2 * B:]])} "
                                       f"(policy version {self.policy_version})")
        routing = self._split_routing(routing)
        now = time.monotonic()
        for i, a in enumerate(active):
            a.times.append(now)
            if routing is not None:
                a.routing.append(routing[i])
            tok = int(host[i])
            a.tokens.append(tok)
            a.logprobs.append(host[B + i])
            self.tokens_generated += 1
            p = a.req.params
            reason = "stop" if tok in p.stop_token_ids else ("length" if len(a.tokens) >= p.max_new_tokens else None)
            if reason is not None:
                finished.append(self._finish(a, reason))
        return finished

    def _admit_prefilled(self, a: _Active) -> Completion | None:
        """Write a handed-over prompt cache into ``a``'s slot and take the prefill server's first
        token as this request's first (its uniform is drawn and dropped, so the next tokens use the
        same uniforms as on a colocated engine). -> the Completion if that token already ends it."""
        pf, P = a.req.prefilled, len(a.req.prompt)
        if self.kv_cache:
            self._ensure_cache(P)
            self._k[:, a.slot, :P] = pf.k.to(self.device)
            self._v[:, a.slot, :P] = pf.v.to(self.device)
        a.fed = P  # the full-recompute reference path ignores the cache and recomputes from the tokens
        a.version = min(a.version, pf.policy_version)
        a.rng.random()
        a.tokens.append(pf.first_token)
        a.logprobs.append(pf.first_logprob)
        a.times.append(pf.first_time)
        if self.capture_routing and pf.routing is not None:
            a.routing.append(pf.routing.long())
        p = a.req.params
        if pf.first_token in p.stop_token_ids:
            return self._finish(a, "stop")
        if p.max_new_tokens <= 1:
            return self._finish(a, "length")
        return None

    def _finish(self, a: _Active, reason: str) -> Completion:
        del self.running[a.req.request_id]
        self.free_slots.append(a.slot)
        routing = None
        if self.capture_routing and a.routing:
            routing = torch.cat([r.long() for r in a.routing], 0).to(self.cfg.routing_dtype())
        kv = None
        if a.req.export_kv and self.kv_cache:
            kv = (self._k[:, a.slot, :a.fed].clone(), self._v[:, a.slot, :a.fed].clone())
        return Completion(a.req.request_id, list(a.req.prompt), a.tokens, a.logprobs, routing, reason,
                          a.version, self.policy_version, kv=kv, token_times=a.times)

    @staticmethod
    def _split_routing(routing):
        """``(r_all [T', L, k] on the device, per-request row counts)`` -> one host copy, split per request."""
        if routing is None:
            return None
        r_all, counts = routing
        return list(r_all.cpu().split(counts))

    def _new_positions(self, a: _Active) -> list[int]:
        """Tokens of ``a`` not yet in its cache: the whole prompt first, then the last sampled one."""
        return list(a.req.prompt) if a.fed == 0 else [a.tokens[-1]]

    # ---------------------------------------------------------------- forward paths
    def _routing_now(self) -> torch.Tensor | None:
        if not self.capture_routing or not any(getattr(layer, "is_moe", False) for layer in self.model.layers):
            return None
        return self.model.routing()

    def _forward_full(self, active: list[_Active]):
        """Reference: recompute each request's full sequence; logits at each last position."""
        seqs = [a.req.prompt + a.tokens for a in active]
        dev = self.device
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long).to(dev)
        pos = torch.cat([torch.arange(len(s)) for s in seqs]).to(dev)
        lens = torch.tensor([len(s) for s in seqs])
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        logits = self.model(ids, pos, cu.to(dev), return_logits=True)
        r_all = self._routing_now()
        routing = None
        if r_all is not None:  # the rows of the positions fed this step: each sequence's new tail
            new = [len(a.req.prompt) if a.fed == 0 else 1 for a in active]
            rows = torch.cat([torch.arange(e - n, e) for n, e in zip(new, cu[1:].tolist())]).to(dev)
            routing = (r_all[rows], new)
        for a, s in zip(active, seqs):
            a.fed = len(s)
        return logits[(cu[1:].long() - 1).to(dev)], routing

    def _ensure_cache(self, need: int) -> None:
        if need <= self._capacity:
            return
        cap = max(need, 2 * self._capacity, 64)
        c = self.cfg
        ref = self.model.embed.weight
        n_layers, shape = c.n_layers, (self.max_batch_size, cap, c.n_kv_heads, c.head_dim)
        mla = getattr(c, "is_mla", False)
        if mla:  # one latent row per token (primerl/models/mla.py); no separate V
            shape = (self.max_batch_size, cap, self.model.layers[0].attention.cache_width())
        nbytes = (1 if mla else 2) * n_layers * math.prod(shape) * ref.element_size()
        if self.kv_cache_gb and nbytes > self.kv_cache_gb * 2**30:
            raise EngineError(f"the KV cache for {self.max_batch_size} slots x {need} positions needs "
                              f"{nbytes / 2**30:.3f} GB (capacity {cap}), "
                              f"over inference.kv_cache_gb = {self.kv_cache_gb:g}; "
                              "raise it, or lower inference.max_batch_size or the generation length")
        k = torch.zeros((n_layers, *shape), dtype=ref.dtype, device=ref.device)
        v = k[..., :0] if mla else torch.zeros_like(k)
        if self._k is not None:
            k[:, :, : self._capacity] = self._k
            v[:, :, : self._capacity] = self._v
        self._k, self._v, self._capacity = k, v, cap

    def _forward_cached(self, active: list[_Active]):
        new_tokens = [self._new_positions(a) for a in active]
        counts = [len(t) for t in new_tokens]
        dev = self.device
        # built on the host, copied in without waiting on the device
        ids = torch.tensor([t for ts in new_tokens for t in ts], dtype=torch.long).to(dev, non_blocking=True)
        pos = torch.cat([torch.arange(a.fed, a.fed + n) for a, n in zip(active, counts)]).to(dev, non_blocking=True)
        slot = torch.cat([torch.full((n,), a.slot, dtype=torch.long) for a, n in zip(active, counts)]).to(
            dev, non_blocking=True)
        S = max(a.fed + n for a, n in zip(active, counts))
        self._ensure_cache(S)
        mask_TS = torch.arange(S, device=dev)[None, :] <= pos[:, None]
        h = self.model.embed(ids)
        T = ids.shape[0]
        mla_state = None
        if getattr(self.cfg, "is_sparse", False):
            from primerl.models.mla import IndexerState

            mla_state = IndexerState()
        for li, layer in enumerate(self.model.layers):
            attn = layer.attention
            if hasattr(attn, "attend_cached"):  # MLA: absorbed form over the latent cache
                h = h + attn.attend_cached(layer.attention_norm(h), pos, self._k[li], slot, mla_state)
                h = h + layer.ffn(layer.ffn_norm(h))
                continue
            q, k, v = attn.project_qkv(layer.attention_norm(h), pos)
            self._k[li, slot, pos] = k.to(self._k.dtype)
            self._v[li, slot, pos] = v.to(self._v.dtype)
            k_all = self._k[li, slot, :S].transpose(1, 2)  # [T, Hkv, S, Dh]
            v_all = self._v[li, slot, :S].transpose(1, 2)
            o = F.scaled_dot_product_attention(q[:, :, None, :], k_all, v_all, attn_mask=mask_TS[:, None, None, :],
                                               scale=attn.softmax_scale, enable_gqa=True)
            h = h + attn.o_proj(o.reshape(T, attn.n_heads * attn.head_dim))
            x = layer.ffn_norm(h)
            h = h + layer.ffn(x)
        last = (torch.tensor(counts).cumsum(0) - 1).to(dev, non_blocking=True)
        logits = self.model.lm_head(self.model.norm(h[last]))
        r_all = self._routing_now()
        routing = None if r_all is None else (r_all, counts)
        for a, n in zip(active, counts):
            a.fed += n
        return logits, routing


def _find_router(moe) -> torch.nn.Module:
    for name in ("router", "gate"):
        m = getattr(moe, name, None)
        if isinstance(m, torch.nn.Module):
            inner = getattr(m, "gate", None) if not isinstance(m, torch.nn.Linear) else None
            return inner if isinstance(inner, torch.nn.Linear) else m
    raise EngineError(f"router_noise: cannot find the router module of {type(moe).__name__}")
