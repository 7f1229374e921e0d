"""Per-token log-probabilities (and entropies) of target tokens under a linear LM head, without
materialising the [T, V] logits.

>>> import torch
>>> from primerl.kernels.logprobs import fused_logprobs
>>> hidden = torch.randn(6, 16, requires_grad=True)      # [T, D]
>>> weight = torch.randn(50, 16, requires_grad=True)     # [V, D] (the LM head)
>>> targets = torch.randint(0, 50, (6,))                 # [T]
>>> logp, ent = fused_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=4)
>>> (logp.sum() + 0.01 * ent.sum()).backward()           # grads w.r.t. hidden and weight

Backends: ``"torch"`` (chunked PyTorch, CPU and GPU) and ``"triton"`` (the same chunk loop with
the per-chunk softmax work in one fused Triton pass per block; matmuls stay torch's: on CUDA with
bf16/fp16 inputs, tensor-core GEMMs with float32 accumulation and float32 logits blocks);
``reference.logprobs_reference`` is the full-logits specification.
"""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from . import chunked
from .chunked import ChunkedLogprobs, TorchChunkOps
from .reference import logprobs_reference

__all__ = ["fused_logprobs", "logprobs_reference"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _inv_temperature(temperature, T: int, device) -> torch.Tensor:
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() == 0:
            temperature = float(temperature)
        else:
            if temperature.shape != (T,):
                raise ValueError(f"fused_logprobs: temperature must be a scalar or shape ({T},), got {tuple(temperature.shape)}")
            if temperature.requires_grad:
                raise ValueError("fused_logprobs: temperature must not require grad (it is a sampling constant)")
            if not bool((temperature > 0).all()):
                raise ValueError("fused_logprobs: every temperature must be > 0")
            return (1.0 / temperature.to(device=device, dtype=torch.float32)).contiguous()
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError(f"fused_logprobs: temperature must be > 0, got {temperature}")
    return torch.full((T,), 1.0 / temperature, dtype=torch.float32, device=device)


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    return_entropy: bool = True,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[t] | hidden[t]) and the entropy of softmax(hidden @ weight.T / temperature).

    Args:
        hidden: [T, D] float32/bf16/fp16 (the final hidden states, one row per predicted token).
        weight: [V, D] same dtype (the LM head).
        targets: [T] integer token ids in [0, V).
        temperature: a float or a [T] tensor (per-token sampling temperature, > 0; no gradient).
        chunk_size: tokens per chunk (logits block and, in backward, gradient block);
            vocab_chunk_size: vocabulary rows per chunk. None picks them
            (``chunked.default_chunk_sizes``): on CUDA with bf16/fp16 inputs, blocks of at most
            half the [T, D] float32 gradient accumulator (at least 64 MiB), the gradient blocks
            spanning all T tokens where that fits; otherwise 1024 x 8192. Peak extra memory in
            backward, besides the gradients it returns: 4 T D bytes (the float32 grad_hidden
            accumulator) plus the larger of the blocks (about 6 * chunk_size * vocab_chunk_size
            for bf16/fp16 on CUDA, 4 or 8 for float32, plus 4 * vocab_chunk_size * D when
            chunk_size < T and the weight is not float32) and, for bf16/fp16 hidden, the 2 T D
            bytes of its rounded copy (the blocks are released before it is made).
        return_entropy: also return the entropy (its gradient flows too).
        backend: None | "torch" | "triton".

    Returns: (logprobs [T] float32, entropy [T] float32 or None). Differentiable w.r.t. hidden and
    weight; backward recomputes each logits chunk.
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"fused_logprobs: hidden must be a 2-D tensor [T, D], got {getattr(hidden, 'shape', type(hidden))}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"fused_logprobs: weight must be a 2-D tensor [V, D], got {getattr(weight, 'shape', type(weight))}")
    T, D = hidden.shape
    V = weight.shape[0]
    if weight.shape[1] != D:
        raise ValueError(f"fused_logprobs: weight must be [V, {D}] to match hidden [T, {D}], got {tuple(weight.shape)}")
    if V == 0:
        raise ValueError("fused_logprobs: weight has an empty vocabulary (V = 0)")
    if hidden.dtype not in _FLOAT_DTYPES or weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"fused_logprobs: hidden/weight dtype must be one of {_FLOAT_DTYPES}, got {hidden.dtype}/{weight.dtype}")
    if hidden.device != weight.device or targets.device != hidden.device:
        raise ValueError(f"fused_logprobs: tensors on different devices: {hidden.device}, {weight.device}, {targets.device}")
    if targets.shape != (T,) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"fused_logprobs: targets must be an integer tensor of shape ({T},), got {targets.dtype} {tuple(targets.shape)}")
    if T and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise ValueError(f"fused_logprobs: targets must lie in [0, {V}), got range [{int(targets.min())}, {int(targets.max())}]")
    for name, size in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"fused_logprobs: chunk sizes must be None or integers >= 1, got {name}={size!r}")
    inv_temp = _inv_temperature(temperature, T, hidden.device)
    unit_temp = not isinstance(temperature, torch.Tensor) and float(temperature) == 1.0
    name = resolve_backend("fused_logprobs", backend, hidden.device, supported=("torch", "triton"),
                           preference=("triton", "torch"))
    if name == "triton":
        from .triton import TritonChunkOps as ops
    else:
        ops = TorchChunkOps
    tz, vc, td = chunked.default_chunk_sizes(T, V, D, chunked.native_low_precision(hidden, weight))
    if chunk_size is not None:  # explicit tokens per block: the gradient blocks have as many
        tz = td = chunk_size
    if vocab_chunk_size is not None:
        vc = vocab_chunk_size
    logprobs, entropy = ChunkedLogprobs.apply(
        hidden.contiguous(), weight.contiguous(), targets.long().contiguous(), inv_temp, unit_temp,
        tz, vc, td, bool(return_entropy), ops)
    return logprobs, (entropy if return_entropy else None)
