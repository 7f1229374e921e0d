"""The chunked log-probabilities as ``torch.library`` custom ops (forward and backward).

``primerl::fused_logprobs_fwd`` / ``primerl::fused_logprobs_bwd`` run the chunk loop of
:mod:`.chunked` with the per-chunk work of the named backend ("torch" or "triton"). Both backends
go through the ops, so ``torch.compile`` (fullgraph), FakeTensorMode, meta tensors and
``torch.export`` see one node per direction with a fake kernel for its shapes: the loop reuses two
block buffers in place, which, traced op by op, would be unrolled per chunk and functionalised
into fresh [Tc, Vc] blocks (the memory bound is the point of the op), and Triton launches are not
traceable on CPU (``triton_op`` + ``wrap_triton`` fails under compile there).

Shapes: T tokens, D hidden size, V vocabulary.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import chunked

__all__ = ["fused_logprobs_fwd", "fused_logprobs_bwd"]


def block_sizes(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int, vocab_chunk_size: int
                ) -> tuple[int, int, int]:
    """(tokens per logits block, vocabulary rows per block, tokens per gradient block); 0 asks for
    ``chunked.default_chunk_sizes``. Resolved inside the ops from the real shapes, so that a
    compiled graph does not specialise on the token count to pick them."""
    T, D = hidden.shape
    tz, vc, td = chunked.default_chunk_sizes(T, weight.shape[0], D, chunked.native_low_precision(hidden, weight))
    if chunk_size:  # explicit tokens per block: the gradient blocks have as many
        tz = td = chunk_size
    if vocab_chunk_size:
        vc = vocab_chunk_size
    return tz, vc, td


def _ops(backend: str):
    if backend == "triton":
        from .triton import TritonChunkOps

        return TritonChunkOps
    if backend != "torch":
        raise ValueError(f"fused_logprobs: backend must be 'torch' or 'triton' here, got {backend!r}")
    return chunked.TorchChunkOps


@torch.library.custom_op("primerl::fused_logprobs_fwd", mutates_args=())
def fused_logprobs_fwd(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor,
                       unit_temp: bool, chunk_size: int, vocab_chunk_size: int, with_entropy: bool, backend: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [T, D], weight [V, D], targets [T] int64 in [0, V), inv_temp [T] float32 ->
    (logprobs, entropy (zeros without with_entropy), m, log1p(r), c), each [T] float32; the last
    three are the statistics backward needs (see chunked.py). Chunk sizes: see ``block_sizes``."""
    tz, vc, _ = block_sizes(hidden, weight, chunk_size, vocab_chunk_size)
    logprobs, entropy, (m, ls, c) = chunked.chunked_forward(hidden, weight, targets, inv_temp, unit_temp, tz, vc,
                                                            with_entropy, _ops(backend))
    if entropy is c:  # without entropy both are one zeros tensor; a custom op's outputs may not alias
        entropy = c.clone()
    return logprobs, entropy, m, ls, c


@fused_logprobs_fwd.register_fake
def _(hidden, weight, targets, inv_temp, unit_temp, chunk_size, vocab_chunk_size, with_entropy, backend):
    T = hidden.shape[0]
    return tuple(hidden.new_empty(T, dtype=torch.float32) for _ in range(5))


@torch.library.custom_op("primerl::fused_logprobs_bwd", mutates_args=())
def fused_logprobs_bwd(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor,
                       logprobs: torch.Tensor, entropy: torch.Tensor, m: torch.Tensor, ls: torch.Tensor,
                       c: torch.Tensor, g_lp: torch.Tensor, g_ent: Optional[torch.Tensor], unit_temp: bool,
                       chunk_size: int, vocab_chunk_size: int, need_hidden: bool, need_weight: bool, backend: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (grad_hidden [T, D] in hidden.dtype, grad_weight [V, D] in weight.dtype); a gradient that
    is not needed comes back as an empty tensor. g_lp [T] float32; g_ent [T] float32 or None (the
    entropy unused)."""
    tz, vc, td = block_sizes(hidden, weight, chunk_size, vocab_chunk_size)
    grad_h, grad_w = chunked.chunked_backward(hidden, weight, targets, inv_temp, unit_temp, logprobs, entropy,
                                              (m, ls, c), g_lp, g_ent, tz, vc, td, need_hidden, need_weight,
                                              _ops(backend))
    return (hidden.new_empty(0) if grad_h is None else grad_h), (weight.new_empty(0) if grad_w is None else grad_w)


@fused_logprobs_bwd.register_fake
def _(hidden, weight, targets, inv_temp, logprobs, entropy, m, ls, c, g_lp, g_ent, unit_temp, chunk_size,
      vocab_chunk_size, need_hidden, need_weight, backend):
    return ((torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)),
            (torch.empty_like(weight) if need_weight else weight.new_empty(0)))


def _setup(ctx, inputs, output):
    hidden, weight, targets, inv_temp, unit_temp, chunk_size, vocab_chunk_size, with_entropy, backend = inputs
    logprobs, entropy, m, ls, c = output
    ctx.save_for_backward(hidden, weight, targets, inv_temp, logprobs, entropy, m, ls, c)
    ctx.cfg = (unit_temp, chunk_size, vocab_chunk_size, with_entropy, backend)


def _backward(ctx, g_lp, g_ent, g_m, g_ls, g_c):
    hidden, weight, targets, inv_temp, logprobs, entropy, m, ls, c = ctx.saved_tensors
    unit_temp, chunk_size, vocab_chunk_size, with_entropy, backend = ctx.cfg
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_h or need_w) or (g_lp is None and (g_ent is None or not with_entropy)):
        return (None,) * 9
    g_lp = torch.zeros_like(m) if g_lp is None else g_lp.float().contiguous()
    g_ent = None if (g_ent is None or not with_entropy) else g_ent.float().contiguous()
    grad_h, grad_w = torch.ops.primerl.fused_logprobs_bwd(
        hidden, weight, targets, inv_temp, logprobs, entropy, m, ls, c, g_lp, g_ent, unit_temp, chunk_size,
        vocab_chunk_size, need_h, need_w, backend)
    return (grad_h if need_h else None), (grad_w if need_w else None), None, None, None, None, None, None, None


fused_logprobs_fwd.register_autograd(_backward, setup_context=_setup)
