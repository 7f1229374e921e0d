"""DeepEPDispatcher: the AllToAllDispatcher interface over DeepEP's ``Buffer`` (NVLink/RDMA kernels).

DeepEP is built from source by users (the PyPI name ``deep-ep`` is an unusable placeholder); this
module imports it lazily, so it loads everywhere and fails with a clear error only when used.

Legend as in :mod:`primerl.parallel.expert`; ``R`` rows DeepEP delivers to this rank (one per
token that has at least one expert here, not one per (token, expert) pair).

Normal mode (training): DeepEP sends each token once per destination rank with its top-k ids
(``-1`` where the expert lives elsewhere) and weights. ``dispatch`` expands those rows into one
row per local (token, expert) pair grouped by local expert, as AllToAllDispatcher returns them.
``combine`` weights each pair by its received top-k weight, sums a token's local pairs in float32
in k order, and lets DeepEP sum the per-rank partials back on the source rank (DeepEP's reduction
order across ranks, bf16 on the wire). Gradients: dispatch's backward is DeepEP's combine and
combine's backward is DeepEP's cached dispatch (the pattern DeepEP documents for training); the
top-k weight gradient flows through the local weighting and DeepEP's weight reduction.

Low-latency mode (decoding): ``low_latency_dispatch`` / ``low_latency_combine`` with padded
per-expert buffers; ``dispatch`` compacts them (one host sync for the counts). Forward only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DeepEPDispatcher", "deep_ep_available"]


def deep_ep_available() -> tuple[bool, str]:
    """Whether ``import deep_ep`` works here and CUDA is present, with the reason when not."""
    if not torch.cuda.is_available():
        return False, "DeepEP needs CUDA devices"
    try:
        import deep_ep  # noqa: F401
    except ImportError as e:
        return False, f"deep_ep is not importable ({e}); build DeepEP from source (the PyPI deep-ep is a placeholder)"
    return True, ""


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, layout):
        num_per_rank, num_per_rdma_rank, num_per_expert, is_in_rank = layout
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=num_per_rank,
            num_tokens_per_rdma_rank=num_per_rdma_rank, is_token_in_rank=is_in_rank,
            num_tokens_per_expert=num_per_expert)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx, handle, counts

    @staticmethod
    def backward(ctx, grad_x, grad_w, _gi, _gh, _gc):
        grad_w = None if grad_w is None else grad_w.float().contiguous()
        gx, gw, _ = ctx.buffer.combine(grad_x.contiguous(), ctx.handle, topk_weights=grad_w)
        return gx, gw, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, buffer, handle):
        ctx.buffer, ctx.handle = buffer, handle
        out, _, _ = buffer.combine(partial, handle)
        return out

    @staticmethod
    def backward(ctx, grad):
        recv_grad, _, _, _, _, _ = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return recv_grad, None, None


@dataclass
class DeepEPHandle:
    num_tokens: int
    top_k: int
    deep_handle: object
    pair_row: torch.Tensor  # [N] received row of each grouped pair
    pair_slot: torch.Tensor  # [N] top-k column of each grouped pair
    num_rows: int  # R
    recv_weights: torch.Tensor | None  # [R, K] float32 (normal mode)
    topk_ids: torch.Tensor | None = None  # low-latency mode: needed by low_latency_combine
    topk_weights: torch.Tensor | None = None
    padded_shape: tuple | None = None
    local_counts_list: list[int] | None = None


class DeepEPDispatcher:
    """``dispatch`` / ``combine`` with AllToAllDispatcher's contract, over a DeepEP ``Buffer``.

    ``buffer``: an existing ``deep_ep.Buffer`` (share one per process); otherwise one is created
    on ``ep_group`` with ``num_nvl_bytes`` (normal) or, with ``low_latency=True``, an RDMA buffer
    sized by DeepEP's hint for ``max_tokens_per_rank`` tokens of ``hidden`` elements.
    """

    def __init__(self, ep_group, num_experts: int, *, buffer=None, low_latency: bool = False,
                 num_nvl_bytes: int = 1 << 30, max_tokens_per_rank: int | None = None, hidden: int | None = None,
                 use_fp8: bool = False):
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if low_latency and (max_tokens_per_rank is None or hidden is None):
            raise ValueError("DeepEPDispatcher: low_latency=True needs max_tokens_per_rank and hidden")
        group = ep_group if ep_group is not None else dist.group.WORLD
        self.ep_size = buffer.group_size if buffer is not None else dist.get_world_size(group)
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the ep group size {self.ep_size}")
        self.num_experts, self.num_local_experts = num_experts, num_experts // self.ep_size
        self.low_latency, self.use_fp8, self.max_tokens_per_rank = low_latency, use_fp8, max_tokens_per_rank
        if buffer is None:
            ok, why = deep_ep_available()
            if not ok:
                raise ImportError(f"DeepEPDispatcher: {why}")
            import deep_ep

            if low_latency:
                rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens_per_rank, hidden, self.ep_size,
                                                                      num_experts)
                buffer = deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=self.num_local_experts)
            else:
                buffer = deep_ep.Buffer(group, num_nvl_bytes, 0)
        self.buffer = buffer

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        if (x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]
                or topk_weights.shape != topk_ids.shape):
            raise ValueError(f"dispatch: need x [T, D], topk_ids and topk_weights [T, K]; got {tuple(x.shape)}, "
                             f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
        if x.dtype != torch.bfloat16:
            raise ValueError(f"dispatch: DeepEP moves bf16 tokens, got x of dtype {x.dtype}")
        if self.low_latency:
            return self._dispatch_low_latency(x, topk_ids, topk_weights)
        T, K = topk_ids.shape
        idx = topk_ids.long()
        num_per_rank, num_per_rdma_rank, num_per_expert, is_in_rank, _ = self.buffer.get_dispatch_layout(
            idx, self.num_experts)
        recv_x, recv_w, recv_idx, deep_handle, counts_list = _Dispatch.apply(
            x, topk_weights.float(), self.buffer, idx, (num_per_rank, num_per_rdma_rank, num_per_expert, is_in_rank))
        # one row per (received token, local expert) pair, grouped by local expert, rows in order
        L = self.num_local_experts
        key = torch.where(recv_idx >= 0, recv_idx, L).reshape(-1)
        order = torch.argsort(key, stable=True)
        local_counts = torch.zeros(L + 1, dtype=torch.int64, device=key.device).index_add_(
            0, key, torch.ones_like(key))[:L]  # bincount would sync on CUDA
        n = sum(counts_list)  # DeepEP's host copy of the received counts: no sync of ours
        order = order[:n]
        pair_row, pair_slot = order // K, order % K
        x_recv = recv_x.index_select(0, pair_row)
        handle = DeepEPHandle(T, K, deep_handle, pair_row, pair_slot, recv_x.shape[0], recv_w)
        return x_recv, local_counts, handle

    def combine(self, y_recv: torch.Tensor, handle: DeepEPHandle, *, out_dtype: torch.dtype | None = None):
        if self.low_latency:
            return self._combine_low_latency(y_recv, handle, out_dtype)
        R, K, D = handle.num_rows, handle.top_k, y_recv.shape[1]
        w = handle.recv_weights[handle.pair_row, handle.pair_slot].unsqueeze(1)
        slots = y_recv.new_zeros(R * K, D, dtype=torch.float32).index_copy(
            0, handle.pair_row * K + handle.pair_slot, y_recv.float() * w).view(R, K, D)
        partial = slots[:, 0]
        for j in range(1, K):
            partial = partial + slots[:, j]
        y = _Combine.apply(partial.to(y_recv.dtype).contiguous(), self.buffer, handle.deep_handle)
        return y.to(out_dtype or y_recv.dtype)

    def _dispatch_low_latency(self, x, topk_ids, topk_weights):
        if torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad):
            raise RuntimeError("DeepEPDispatcher: low-latency mode is forward-only (decoding); "
                               "use the normal mode to train")
        idx = topk_ids.long()
        recv, counts, deep_handle, _, _ = self.buffer.low_latency_dispatch(
            x, idx, self.max_tokens_per_rank, self.num_experts, use_fp8=self.use_fp8)
        if self.use_fp8:
            q, sf = recv
            recv = (q.float() * sf.repeat_interleave(128, dim=-1)[..., :q.shape[-1]]).to(x.dtype)
        counts_list = counts.tolist()  # the host sync of this layer
        x_recv = torch.cat([recv[e, :c] for e, c in enumerate(counts_list)])
        handle = DeepEPHandle(x.shape[0], idx.shape[1], deep_handle, None, None, 0, None, idx, topk_weights.float(),
                              tuple(recv.shape), counts_list)
        return x_recv, counts.long(), handle

    def _combine_low_latency(self, y_recv, handle, out_dtype):
        padded = y_recv.new_zeros(handle.padded_shape, dtype=torch.bfloat16)
        start = 0
        for e, c in enumerate(handle.local_counts_list):
            padded[e, :c] = y_recv[start:start + c]
            start += c
        y, _, _ = self.buffer.low_latency_combine(padded, handle.topk_ids, handle.topk_weights, handle.deep_handle)
        return y.to(out_dtype or y_recv.dtype)
