"""The MoE feed-forward block: router (with replay), routed SwiGLU experts, optional shared experts.

Legend: T tokens (leading dims of x flattened), D = ``dim``, I = ``moe_dim``, E = ``num_experts``,
k = ``top_k``.

Parameters (names chosen so Hugging Face checkpoints map one to one):
  ``gate.weight [E, D]``                       router (HF ``mlp.gate.weight``)
  ``expert_bias [E]`` (buffer, fp32)           selection-only bias (GLM-4.5 ``e_score_correction_bias``)
  ``experts.w13 [E, 2I, D]``                   gate rows 0..I-1, up rows I..2I-1 (HF ``gate_up_proj``)
  ``experts.w2 [E, D, I]``                     down projection (HF ``down_proj``)
  ``shared_experts.{gate,up,down}_proj``       dense SwiGLU MLP of width I * num_shared_experts

Presets: Qwen3-MoE = ``MoE(D, I, E, k, score_func="softmax", route_norm=config.norm_topk_prob)``;
GLM-4.5-MoE = ``MoE(D, I, E, k, num_shared_experts=n, score_func="sigmoid", route_norm=True,
route_scale=routed_scaling_factor, n_groups=n_group, topk_groups=topk_group,
use_expert_bias=True)``; :meth:`MoE.from_hf_config` builds either from a transformers config.

Expert parallelism: :meth:`MoE.set_dispatcher` takes any object with
``dispatch(x [T, D], topk_ids [T, k], topk_weights [T, k]) -> (x_recv [M, D], local_counts [E_local], handle)``
(x_recv's rows grouped contiguously by local expert, ``local_counts.sum() == M``) and
``combine(y_recv [M, D], handle) -> y [T, D]`` (applies the weights, sums the k copies). The local
computation between them is :meth:`GroupedExperts.forward_grouped`, ``(x_recv, local_counts) ->
y_recv``, an unweighted SwiGLU MLP per row with the expert weights the module holds (the
dispatcher's owner shards ``experts.w13`` / ``experts.w2`` to the local experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from primerl.kernels.moe import expert_counts, fused_experts, topk_route
from primerl.kernels.moe import reference as moe_reference
from primerl.kernels.moe._functions import backend_impl, experts_on_grouped_rows
from primerl.kernels._backend import resolve_backend


class Router(nn.Module):
    """Linear gate: x [T, D] -> logits [T, E] (float32 when ``fp32`` is set, else x's dtype)."""

    def __init__(self, dim: int, num_experts: int, fp32: bool = True, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim, device=device, dtype=dtype))
        self.fp32 = fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored fused: w13 [E, 2I, D] and w2 [E, D, I]."""

    def __init__(self, dim: int, moe_dim: int, num_experts: int, backend: str | None = None, device=None, dtype=None):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * moe_dim, dim, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, moe_dim, device=device, dtype=dtype))
        self.backend = backend
        self.fp8_recipe = None

    def enable_fp8(self, recipe) -> None:
        """Run the grouped GEMMs in FP8 with ``recipe`` ("blockwise" / "blockwise_fp8_wgrad" / "rowwise", or an
        object with that ``name``); called by primerl's convert_to_fp8. None switches back to bf16."""
        if recipe is not None:
            from primerl.kernels.moe.fp8 import check_shapes, recipe_name

            recipe_name(recipe)
            check_shapes("GroupedExperts.enable_fp8", self.w13.shape[2], self.w2.shape[2])
        self.fp8_recipe = recipe

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], topk_ids/topk_weights [T, k] -> y [T, D] (weighted sum over the k experts)."""
        if getattr(self, "lora_A13", None) is not None and not (self.lora_merged or self.lora_disabled):  # LoRA
            from .lora import experts_lora_forward

            return experts_lora_forward(self, x, topk_ids, topk_weights)
        return fused_experts(
            x, self.w13, self.w2, topk_ids, topk_weights, fp8_recipe=self.fp8_recipe, backend=self.backend
        )

    def forward_grouped(self, x_recv: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        """x_recv [M, D] grouped by expert (``local_counts [E]`` rows each) -> y_recv [M, D], unweighted."""
        if local_counts.shape != (self.w13.shape[0],):
            raise ValueError(
                f"forward_grouped: local_counts must have shape ({self.w13.shape[0]},), got {tuple(local_counts.shape)}"
            )
        if getattr(self, "lora_A13", None) is not None and not (self.lora_merged or self.lora_disabled):  # LoRA
            from .lora import experts_lora_on_grouped_rows

            return experts_lora_on_grouped_rows(self, x_recv.contiguous(), local_counts.cumsum(0).to(torch.int32))
        if x_recv.shape[0] == 0 and self.fp8_recipe is not None:  # an ep rank that got no rows: the FP8
            # quantizers reject empty input. Output from x_recv and the weights, so the graph still
            # reaches both (FSDP's post-backward hooks hang on the input, the reduce-scatter needs the grads).
            return x_recv * 0 + 0 * (self.w13.sum() + self.w2.sum()).to(x_recv.dtype)
        be = resolve_backend("forward_grouped", self.backend, x_recv.device, supported=("torch", "triton"))
        ends = local_counts.cumsum(0).to(torch.int32)
        return experts_on_grouped_rows(x_recv.contiguous(), self.w13, self.w2, ends, backend_impl(be), self.fp8_recipe)


class SharedExperts(nn.Module):
    """A dense SwiGLU MLP applied to every token (DeepSeek / GLM shared experts)."""

    def __init__(self, dim: int, hidden: int, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(dim, hidden, **kw)
        self.up_proj = nn.Linear(dim, hidden, **kw)
        self.down_proj = nn.Linear(hidden, dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Routed SwiGLU experts with top-k routing, router replay and aux-loss-free balancing.

    ``forward(x [..., D], replay_ids=None [..., k]) -> y [..., D]``. After each forward,
    ``self.routing`` holds the top-k ids actually used ([T, k] int32; the replayed ids under
    replay) and ``self.aux_loss`` the load-balancing loss (``load_balance_coeff`` times the
    Switch loss ``E * sum_e f_e * P_e``) or None. Both balancing signals (``aux_loss`` and the
    ``tokens_per_expert`` counts behind :meth:`update_expert_bias`) come from the router's live
    top-k, never from replayed ids: they steer the live router.
    """

    def __init__(
        self,
        dim: int,
        moe_dim: int,
        num_experts: int,
        top_k: int,
        num_shared_experts: int = 0,
        score_func: str = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        n_groups: int = 1,
        topk_groups: int = 1,
        use_expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
        load_balance_coeff: float | None = None,
        router_fp32: bool = True,
        dispatcher=None,
        backend: str | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE: score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if n_groups < 1 or num_experts % n_groups or not 1 <= topk_groups <= n_groups:
            raise ValueError(
                f"MoE: n_groups={n_groups} must divide E={num_experts}; topk_groups={topk_groups} in [1, n_groups]"
            )
        self.dim, self.moe_dim, self.num_experts, self.top_k = dim, moe_dim, num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, float(route_scale)
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.bias_update_rate = bias_update_rate
        self.load_balance_coeff = load_balance_coeff
        self.gate = Router(dim, num_experts, fp32=router_fp32, device=device, dtype=dtype)
        self.experts = GroupedExperts(dim, moe_dim, num_experts, backend=backend, device=device, dtype=dtype)
        self.shared_experts = None
        if num_shared_experts > 0:
            self.shared_experts = SharedExperts(dim, moe_dim * num_shared_experts, device=device, dtype=dtype)
        if use_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
            self.register_buffer("tokens_per_expert", torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None
            self.tokens_per_expert = None
        self.dispatcher = dispatcher
        self.routing: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None
        self.reset_parameters()

    @classmethod
    def from_hf_config(cls, config, **kwargs) -> "MoE":
        """Build from a transformers Qwen3-MoE / GLM-4.5-MoE (or similar) config."""
        num_experts = (
            getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
            or config.num_local_experts
        )
        n_shared = getattr(config, "n_shared_experts", 0) or 0
        is_sigmoid = hasattr(config, "routed_scaling_factor") or hasattr(config, "n_group")
        args = dict(
            dim=config.hidden_size,
            moe_dim=config.moe_intermediate_size,
            num_experts=num_experts,
            top_k=config.num_experts_per_tok,
            num_shared_experts=n_shared,
            score_func="sigmoid" if is_sigmoid else "softmax",
            route_norm=bool(getattr(config, "norm_topk_prob", False)),
            route_scale=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
            n_groups=getattr(config, "n_group", 1) or 1,
            topk_groups=getattr(config, "topk_group", 1) or 1,
            use_expert_bias=is_sigmoid,
        )
        args.update(kwargs)
        return cls(**args)

    @torch.no_grad()
    def reset_parameters(self, init_std: float = 0.02) -> None:
        for p in (self.gate.weight, self.experts.w13, self.experts.w2):
            nn.init.trunc_normal_(p, std=init_std)
        if self.shared_experts is not None:
            for lin in (self.shared_experts.gate_proj, self.shared_experts.up_proj, self.shared_experts.down_proj):
                nn.init.trunc_normal_(lin.weight, std=init_std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()

    def set_dispatcher(self, dispatcher) -> None:
        """Route through an expert-parallel dispatcher (see the module docstring); None to stop."""
        self.dispatcher = dispatcher

    def _route(self, logits: torch.Tensor, replay_ids: torch.Tensor | None):
        return topk_route(
            logits,
            self.top_k,
            score_func=self.score_func,
            n_groups=self.n_groups,
            topk_groups=self.topk_groups,
            expert_bias=self.expert_bias,
            route_norm=self.route_norm,
            route_scale=self.route_scale,
            replay_ids=replay_ids,
        )

    def _balancing(self, logits: torch.Tensor, topk_ids: torch.Tensor, replayed: bool) -> None:
        need_counts = self.tokens_per_expert is not None and self.training
        if self.load_balance_coeff is None and not need_counts:
            self.aux_loss = None
            return
        scores = moe_reference.scores_from_logits(logits, self.score_func)
        with torch.no_grad():
            live = (
                moe_reference.select_experts(scores, self.top_k, self.n_groups, self.topk_groups, self.expert_bias)
                if replayed
                else topk_ids
            )
            counts = expert_counts(live, self.num_experts).float()
        if need_counts:
            self.tokens_per_expert.add_(counts)
        if self.load_balance_coeff is None:
            self.aux_loss = None
            return
        probs = scores if self.score_func == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
        frac = counts / max(live.numel(), 1)
        self.aux_loss = self.load_balance_coeff * self.num_experts * (frac * probs.mean(0)).sum()

    def forward(self, x: torch.Tensor, replay_ids: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if replay_ids is not None:
            flat_ok = tuple(replay_ids.shape) == (x2.shape[0], self.top_k)
            if tuple(replay_ids.shape[:-1]) != tuple(shape[:-1]) and not flat_ok:
                raise ValueError(
                    f"MoE.forward: replay_ids must have shape {tuple(shape[:-1]) + (self.top_k,)} "
                    f"or {(x2.shape[0], self.top_k)}, got {tuple(replay_ids.shape)}"
                )
            replay_ids = replay_ids.reshape(-1, replay_ids.shape[-1])
        logits = self.gate(x2)
        topk_ids, topk_weights = self._route(logits, replay_ids)
        self.routing = topk_ids.detach()
        self._balancing(logits, topk_ids, replayed=replay_ids is not None)
        if self.dispatcher is None:
            y = self.experts(x2, topk_ids, topk_weights)
        else:
            x_recv, local_counts, handle = self.dispatcher.dispatch(x2, topk_ids, topk_weights)
            y_recv = self.experts.forward_grouped(x_recv, local_counts)
            y = self.dispatcher.combine(y_recv, handle)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x2)
        return y.reshape(shape)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing step (DeepSeek-V3): bias += rate * sign(mean(c) - c), centred.

        Call after the optimizer step. ``tokens_per_expert`` overrides the counts accumulated since
        the last update (pass them all-reduced over data-parallel ranks); the accumulator is reset.
        """
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias: this MoE was built with use_expert_bias=False")
        c = self.tokens_per_expert if tokens_per_expert is None else tokens_per_expert.float()
        delta = self.bias_update_rate * torch.sign(c.mean() - c)
        self.expert_bias.add_(delta - delta.mean())
        self.tokens_per_expert.zero_()

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, moe_dim={self.moe_dim}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score_func={self.score_func}, route_norm={self.route_norm}, route_scale={self.route_scale}, "
            f"n_groups={self.n_groups}, topk_groups={self.topk_groups}"
        )


__all__ = ["MoE", "Router", "GroupedExperts", "SharedExperts"]
