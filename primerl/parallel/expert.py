"""Expert parallelism: move each token's k expert slots to the ranks that hold those experts.

With ``ep`` ranks and ``E`` experts, rank ``r`` holds experts ``[r*E/ep, (r+1)*E/ep)``.

Shape legend: ``T`` tokens on this rank, ``K`` top-k, ``D`` hidden size, ``E`` experts,
``W`` ep ranks, ``L = E / W`` local experts, ``N`` rows received (sum of ``local_counts``).

``dispatch(x_TD, topk_ids_TK, topk_weights_TK) -> (x_recv_ND, local_counts_L, handle)``: every
(token, slot) pair becomes one row sent to the owner of its expert; the received rows are grouped
by local expert (expert 0's rows first; inside an expert, by source rank then source order).
``combine(y_recv_ND, handle) -> y_TD``: the reverse exchange, then each token's k outputs summed
weighted by ``topk_weights`` in float32, in fixed k order (slot 0 first) so results are
reproducible. Both are differentiable: gradients flow to ``x``, ``topk_weights`` and everything
computed on ``x_recv``.

Host syncs: one per ``dispatch`` (the split sizes, plus the id range check folded into the same
copy); ``combine`` reuses them. FP8 dispatch quantizes per token group of ``fp8_group_size``
before the exchange (1 byte per element plus one float32 scale per group instead of 2 bytes per
element in bf16) and dequantizes after; gradients travel back unquantized (straight-through).
The received FP8 payload stays available as ``handle.recv_fp8 = (q_ND, sf_NG)`` so an FP8 grouped
GEMM can consume it without quantizing again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..kernels.fp8 import quant_per_token_group

__all__ = ["AllToAllDispatcher", "DispatchHandle", "all_to_all_single_autograd", "apply_expert_parallel",
           "local_expert_range"]


def local_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """``[start, end)`` of the experts that rank ``ep_rank`` of ``ep_size`` holds."""
    if ep_size <= 0 or num_experts % ep_size != 0:
        raise ValueError(f"num_experts={num_experts} must be divisible by the ep size {ep_size}")
    n = num_experts // ep_size
    return ep_rank * n, (ep_rank + 1) * n


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its gradient is the exchange with splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all_single_autograd(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None):
    """Differentiable uneven all-to-all along dim 0 (row counts per peer on the host)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def _pack_fp8(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [N, D] -> bytes [N, D + 4*D/group_size]: fp8 values then float32 scales, one row per token."""
    q, sf = quant_per_token_group(x, group_size)
    return torch.cat([q.view(torch.uint8), sf.contiguous().view(torch.uint8)], dim=1)


def _unpack_fp8(packed: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = packed[:, :dim].contiguous().view(torch.float8_e4m3fn)
    sf = packed[:, dim:].contiguous().view(torch.float32)
    return q, sf


class _SendTokens(torch.autograd.Function):
    """Gather each slot's token row in expert order and exchange it; optionally in FP8.

    Forward: x [T, D] -> rows [N_recv, D] (x's dtype; dequantized when FP8, and the FP8 rows and
    scales as two extra non-differentiable outputs). FP8 quantizes each token once, before the
    k-fold gather. Backward: the reverse exchange in x's dtype (straight-through for FP8), then
    each token's k slot gradients summed in float32 in slot order: no scatter-add, so the
    result does not depend on atomics.
    """

    @staticmethod
    def forward(ctx, x, slot_order, slot_inverse, top_k, recv_splits, send_splits, group, fp8_group_size):
        ctx.save_for_backward(slot_inverse)
        ctx.top_k, ctx.splits, ctx.group = top_k, (recv_splits, send_splits), group
        dim, local = x.shape[1], group is _LOCAL
        src_token = torch.div(slot_order, top_k, rounding_mode="floor")
        if fp8_group_size is None:
            send = x.index_select(0, src_token)
            recv = send if local else _exchange(send, recv_splits, send_splits, group)
            return recv, None, None
        width = dim + 4 * (dim // fp8_group_size)
        packed = _pack_fp8(x, fp8_group_size) if x.shape[0] else x.new_zeros(0, width, dtype=torch.uint8)
        send = packed.index_select(0, src_token)
        recv = send if local else _exchange(send, recv_splits, send_splits, group)
        q, sf = _unpack_fp8(recv, dim)
        x_recv = (q.float().view(-1, dim // fp8_group_size, fp8_group_size) * sf.unsqueeze(-1)).view(-1, dim)
        ctx.mark_non_differentiable(q, sf)
        return x_recv.to(x.dtype), q, sf

    @staticmethod
    def backward(ctx, grad, _gq=None, _gsf=None):
        (slot_inverse,) = ctx.saved_tensors
        recv_splits, send_splits = ctx.splits
        g = grad if ctx.group is _LOCAL else _exchange(grad, send_splits, recv_splits, ctx.group)
        g = g.index_select(0, slot_inverse).view(-1, ctx.top_k, g.shape[1])
        grad_x = g[:, 0].float()
        for j in range(1, ctx.top_k):
            grad_x = grad_x + g[:, j].float()
        return grad_x.to(grad.dtype), None, None, None, None, None, None, None


_LOCAL = object()  # stands for "no exchange" (one ep rank)


@dataclass
class DispatchHandle:
    """What ``combine`` needs to undo a ``dispatch`` (one per layer and micro-batch)."""

    num_tokens: int
    top_k: int
    slot_order: torch.Tensor  # [T*K] slot index of each sent row (rows sorted by expert)
    slot_inverse: torch.Tensor  # [T*K] position of each slot among the sent rows
    regroup: torch.Tensor | None  # [N] received row (src-major) of each grouped row; None = identity
    regroup_inverse: torch.Tensor | None
    send_splits: list[int]  # rows sent to each ep rank
    recv_splits: list[int]  # rows received from each ep rank
    local_counts_list: list[int]  # rows per local expert (host copy of local_counts)
    topk_weights: torch.Tensor  # [T, K]
    recv_fp8: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)


class AllToAllDispatcher:
    """Expert-parallel token exchange over ``ep_group`` with ``all_to_all_single``.

    ``ep_group=None`` means the default group when torch.distributed is initialized, and a
    single-rank dispatcher (a local sort by expert, no communication) when it is not.

    >>> disp = AllToAllDispatcher(None, num_experts=4)
    >>> x, ids, w = torch.randn(5, 8), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    >>> x_recv, counts, h = disp.dispatch(x, ids, w)    # x_recv [10, 8], counts [4]
    >>> y = disp.combine(x_recv, h)                       # [5, 8] = sum_k w[:, k] * x
    """

    def __init__(self, ep_group, num_experts: int, *, fp8_dispatch: bool = False, fp8_group_size: int = 128):
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if fp8_group_size <= 0:
            raise ValueError(f"fp8_group_size must be positive, got {fp8_group_size}")
        distributed = dist.is_available() and dist.is_initialized()
        if ep_group is not None and not distributed:
            raise ValueError("ep_group was given but torch.distributed is not initialized")
        self.group = ep_group
        self.ep_size = dist.get_world_size(ep_group) if distributed else 1
        self.ep_rank = dist.get_rank(ep_group) if distributed else 0
        if num_experts % self.ep_size != 0:
            raise ValueError(f"num_experts={num_experts} must be divisible by the ep group size {self.ep_size}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.local_expert_start = self.ep_rank * self.num_local_experts
        self.fp8_dispatch = fp8_dispatch
        self.fp8_group_size = fp8_group_size

    def __repr__(self) -> str:
        return (f"AllToAllDispatcher(ep_size={self.ep_size}, ep_rank={self.ep_rank}, num_experts={self.num_experts}, "
                f"fp8_dispatch={self.fp8_dispatch})")

    def _check(self, x, topk_ids, topk_weights) -> None:
        if x.dim() != 2:
            raise ValueError(f"dispatch: x must be [T, D], got shape {tuple(x.shape)}")
        if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
            raise ValueError(f"dispatch: topk_ids must be [T={x.shape[0]}, K], got shape {tuple(topk_ids.shape)}")
        if topk_ids.shape[1] == 0:
            raise ValueError("dispatch: topk_ids must have at least one column (K >= 1)")
        if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
            raise ValueError(f"dispatch: topk_ids must be an integer tensor, got {topk_ids.dtype}")
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(f"dispatch: topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids shape "
                             f"{tuple(topk_ids.shape)}")
        if not topk_weights.dtype.is_floating_point:
            raise ValueError(f"dispatch: topk_weights must be floating point, got {topk_weights.dtype}")
        if self.fp8_dispatch:
            if x.shape[1] % self.fp8_group_size != 0:
                raise ValueError(f"dispatch: fp8 dispatch needs D={x.shape[1]} divisible by fp8_group_size="
                                 f"{self.fp8_group_size}")
            if not x.dtype.is_floating_point or x.element_size() < 2:
                raise ValueError(f"dispatch: fp8 dispatch needs a float32/bf16/fp16 x, got {x.dtype}")

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """x ``[T, D]``, topk_ids ``[T, K]`` (global expert ids), topk_weights ``[T, K]`` ->
        ``(x_recv [N, D], local_counts [L] int64, handle)``."""
        self._check(x, topk_ids, topk_weights)
        num_tokens, top_k = topk_ids.shape
        E, W, L = self.num_experts, self.ep_size, self.num_local_experts
        device = x.device
        ids = topk_ids.reshape(-1).long()
        in_range = (ids >= 0) & (ids < E)
        counts = torch.zeros(E, dtype=torch.int64, device=device)
        counts.index_add_(0, ids.clamp(0, E - 1), in_range.long())
        n_bad = (ids.numel() - in_range.sum()).view(1, 1)
        if W > 1:
            # Each peer also learns how many bad ids every rank has, so all ranks raise together
            # instead of some waiting forever in the payload exchange.
            send = torch.cat([counts.view(W, L), n_bad.expand(W, 1)], dim=1).reshape(-1)
            recv = _exchange(send, [L + 1] * W, [L + 1] * W, self.group).view(W, L + 1)  # src-major
            recv_counts_WL, bad_WL = recv[:, :L], recv[:, L]
        else:
            recv_counts_WL, bad_WL = counts.view(1, L), n_bad.view(1)
        local_counts = recv_counts_WL.sum(0)
        # The one host sync of the layer: split sizes, local counts and the id checks together.
        meta = torch.cat([counts.view(W, L).sum(1), recv_counts_WL.sum(1), local_counts, bad_WL]).tolist()
        bad = meta[2 * W + L:]
        if any(bad):
            where = ", ".join(f"ep rank {r}: {b}" for r, b in enumerate(bad) if b)
            raise ValueError(f"dispatch: topk_ids outside [0, num_experts={E}) ({where})")
        send_splits, recv_splits, local_counts_list = meta[:W], meta[W:2 * W], meta[2 * W:2 * W + L]

        slot_order = torch.argsort(ids, stable=True)
        slot_inverse = torch.empty_like(slot_order)
        slot_inverse[slot_order] = torch.arange(slot_order.numel(), device=device)
        group = self.group if W > 1 else _LOCAL
        x_recv, q, sf = _SendTokens.apply(x, slot_order, slot_inverse, top_k, recv_splits, send_splits, group,
                                          self.fp8_group_size if self.fp8_dispatch else None)
        recv_fp8 = (q, sf) if self.fp8_dispatch else None

        regroup = regroup_inverse = None
        if W > 1 and L > 1:
            regroup = _src_major_to_expert_major(recv_counts_WL.contiguous(), sum(recv_splits))
            regroup_inverse = torch.empty_like(regroup)
            regroup_inverse[regroup] = torch.arange(regroup.numel(), device=device)
            x_recv = x_recv.index_select(0, regroup)
            if recv_fp8 is not None:
                recv_fp8 = (recv_fp8[0].view(torch.uint8).index_select(0, regroup).view(torch.float8_e4m3fn),
                            recv_fp8[1].index_select(0, regroup))
        handle = DispatchHandle(num_tokens, top_k, slot_order, slot_inverse, regroup, regroup_inverse,
                                send_splits, recv_splits, local_counts_list, topk_weights, recv_fp8)
        return x_recv, local_counts, handle

    def combine(self, y_recv: torch.Tensor, handle: DispatchHandle, *, out_dtype: torch.dtype | None = None):
        """y_recv ``[N, D]`` (rows in ``dispatch``'s order) -> y ``[T, D]`` = sum_k w[:, k] * y_k,
        accumulated in float32 in slot order, returned as ``out_dtype`` (default: y_recv's)."""
        n_recv = sum(handle.recv_splits)
        if y_recv.dim() != 2 or y_recv.shape[0] != n_recv:
            raise ValueError(f"combine: y_recv must be [N={n_recv}, D], got shape {tuple(y_recv.shape)}")
        if handle.regroup_inverse is not None:
            y_recv = y_recv.index_select(0, handle.regroup_inverse)
        if self.ep_size > 1:
            y_back = all_to_all_single_autograd(y_recv, handle.send_splits, handle.recv_splits, self.group)
        else:
            y_back = y_recv
        T, K, D = handle.num_tokens, handle.top_k, y_recv.shape[1]
        y_slots = y_back.index_select(0, handle.slot_inverse).view(T, K, D)
        w = handle.topk_weights.float()
        out = y_slots[:, 0].float() * w[:, 0:1]
        for j in range(1, K):
            out = out + y_slots[:, j].float() * w[:, j:j + 1]
        return out.to(out_dtype or y_recv.dtype)


def _src_major_to_expert_major(counts_WL: torch.Tensor, total: int) -> torch.Tensor:
    """Rows arrive ordered (source rank, local expert); return, for the (local expert, source
    rank) order, the arriving row of each position. counts_WL [W, L] -> index [total]."""
    W, L = counts_WL.shape
    src_start = (torch.cumsum(counts_WL.reshape(-1), 0) - counts_WL.reshape(-1)).view(W, L)
    counts_LW = counts_WL.t().reshape(-1)
    block_start = torch.cumsum(counts_LW, 0) - counts_LW
    block = torch.repeat_interleave(torch.arange(W * L, device=counts_WL.device), counts_LW, output_size=total)
    within = torch.arange(total, device=counts_WL.device) - block_start[block]
    return src_start.t().reshape(-1)[block] + within


def apply_expert_parallel(model: torch.nn.Module, ep_mesh, *, fp8_dispatch: bool = False,
                          fp8_group_size: int = 128) -> list[AllToAllDispatcher]:
    """Give every MoE module of ``model`` an AllToAllDispatcher over ``ep_mesh`` (the ``ep`` view
    of ``build_mesh``, or a process group) and cut its expert weights to the local experts.

    An MoE module is any module with ``num_experts`` and ``set_dispatcher``; its expert weights
    are the parameters of its ``experts`` child whose first dim is ``num_experts``. Call before
    FSDP. With one ep rank nothing changes (the module computes all experts locally).
    """
    group = ep_mesh.get_group() if hasattr(ep_mesh, "get_group") else ep_mesh
    ep_size = dist.get_world_size(group)
    ep_rank = dist.get_rank(group)
    moes = []
    for name, module in model.named_modules():  # validate every MoE before changing any
        if not (hasattr(module, "set_dispatcher") and isinstance(getattr(module, "num_experts", None), int)):
            continue
        if getattr(module, "experts", None) is None:
            raise ValueError(f"apply_expert_parallel: MoE module {name!r} has no `experts` child holding the weights")
        moes.append((module, local_expert_range(module.num_experts, ep_size, ep_rank)))
    dispatchers = []
    if ep_size == 1:
        return dispatchers
    for module, (start, end) in moes:
        experts = module.experts
        for pname, p in list(experts.named_parameters(recurse=False)):
            if p.dim() >= 1 and p.shape[0] == module.num_experts:
                local = torch.nn.Parameter(p.detach()[start:end].clone(), requires_grad=p.requires_grad)
                setattr(experts, pname, local)
        disp = AllToAllDispatcher(group, module.num_experts, fp8_dispatch=fp8_dispatch, fp8_group_size=fp8_group_size)
        module.set_dispatcher(disp)
        dispatchers.append(disp)
    return dispatchers
