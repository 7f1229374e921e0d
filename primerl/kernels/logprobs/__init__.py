"""Per-token log-probabilities (and entropies) of target tokens under a linear LM head, without
materialising the [T, V] logits.

>>> import torch
>>> from primerl.kernels.logprobs import fused_logprobs
>>> hidden = torch.randn(6, 16, requires_grad=True)      # [T, D]
>>> weight = torch.randn(50, 16, requires_grad=True)     # [V, D] (the LM head)
>>> targets = torch.randint(0, 50, (6,))                 # [T]
>>> logp, ent = fused_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=4)
>>> (logp.sum() + 0.01 * ent.sum()).backward()           # grads w.r.t. hidden and weight

Packed RL batches are token-aligned (entry t describes token t); the targets of fused_logprobs are
the *next* tokens: :func:`primerl.rl.next_token_batch` does that shift.

Under ``torch.compile`` (fullgraph), FakeTensorMode and on meta tensors the op is two
``torch.library`` custom ops, ``primerl::fused_logprobs_fwd`` / ``_bwd`` (see :mod:`.op`), with
fake kernels and autograd; the value check of the targets is a device assertion
(:func:`primerl.kernels.check_values`), so nothing reads the host.

Backends: ``"torch"`` (chunked PyTorch, CPU and GPU) and ``"triton"`` (the same chunk loop with
the per-chunk softmax work in one fused Triton pass per block; matmuls stay torch's: on CUDA with
bf16/fp16 inputs, tensor-core GEMMs with float32 accumulation and float32 logits blocks);
``reference.logprobs_reference`` is the full-logits specification.
"""

from __future__ import annotations

import math

import torch

from .._backend import resolve_backend
from .._value_checks import check_values
from .op import fused_logprobs_bwd, fused_logprobs_fwd  # noqa: F401  (registers the custom ops)
from .reference import logprobs_reference

__all__ = ["fused_logprobs", "logprobs_reference", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # Hugging Face's and Liger's convention for targets outside the loss

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _inv_temperature(temperature, lead: tuple, device) -> tuple[torch.Tensor, bool]:
    """-> (1 / temperature as a [T] float32 tensor, whether it is exactly 1 (a Python 1.0))."""
    T = math.prod(lead)
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() != 0 and temperature.shape != lead:
            raise ValueError(f"fused_logprobs: temperature must be a scalar or shape {lead} (one per token), "
                             f"got {tuple(temperature.shape)}")
        if temperature.requires_grad:
            raise ValueError("fused_logprobs: temperature must not require grad (it is a sampling constant)")
        if temperature.dtype == torch.bool or not (temperature.dtype.is_floating_point or temperature.dtype in
                                                   (torch.int32, torch.int64)):
            raise ValueError(f"fused_logprobs: temperature must be a float tensor, got {temperature.dtype}")
        temperature = temperature.to(device)  # a copy to the device, not a read back
        check_values((temperature > 0).all(), "fused_logprobs: every temperature must be > 0",
                     lambda: f"min {float(temperature.min())}")
        # 1 / t in float64, rounded once: the value a Python float temperature gives
        inv = (1.0 / temperature.double()).float()
        return inv.expand(lead).reshape(T).contiguous(), False
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError(f"fused_logprobs: temperature must be > 0, got {temperature}")
    return torch.full((T,), 1.0 / temperature, dtype=torch.float32, device=device), temperature == 1.0


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int | None = IGNORE_INDEX,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    return_entropy: bool = True,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[t] | hidden[t]) and the entropy of softmax((hidden @ weight.T + bias) / temperature).

    Args:
        hidden: [T, D] or [B, T, D] float32/bf16/fp16 (the final hidden states, one row per
            predicted token).
        weight: [V, D] same dtype (the LM head).
        targets: [T] (or [B, T]) integer token ids in [0, V), or ``ignore_index``.
        bias: optional [V] LM-head bias, same dtype as weight (it gets a gradient too). Costs one
            [V, D+1] copy of the weight (the bias rides as an extra hidden column of ones).
        temperature: a float, a 0-d tensor or a per-token [T] (or [B, T]) tensor (the sampling
            temperature, > 0; no gradient).
        ignore_index: targets equal to it (default -100, as Hugging Face and Liger) get
            log-prob 0 and entropy 0, and pass no gradient; None: every target must be in [0, V).
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

    Returns: (logprobs, entropy or None), float32, shaped like targets. Differentiable w.r.t.
    hidden, weight and bias; backward recomputes each logits chunk.

    Targets outside [0, V) (other than ``ignore_index``) fail a device assertion
    (:func:`primerl.kernels.check_values`; a ValueError naming the range in debug mode).
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3):
        raise ValueError(f"fused_logprobs: hidden must be a tensor [T, D] or [B, T, D], got "
                         f"{getattr(hidden, 'shape', type(hidden))}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("fused_logprobs: weight must be a 2-D tensor [V, D], got "
                         f"{getattr(weight, 'shape', type(weight))}")
    lead, D = tuple(hidden.shape[:-1]), hidden.shape[-1]
    V = weight.shape[0]
    if weight.shape[1] != D:
        raise ValueError(f"fused_logprobs: weight must be [V, {D}] to match hidden [..., {D}], "
                         f"got {tuple(weight.shape)}")
    if V == 0:
        raise ValueError("fused_logprobs: weight has an empty vocabulary (V = 0)")
    if hidden.dtype not in _FLOAT_DTYPES or weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"fused_logprobs: hidden/weight dtype must be one of {_FLOAT_DTYPES}, "
                         f"got {hidden.dtype}/{weight.dtype}")
    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"fused_logprobs: targets must be an integer tensor of shape {lead}, "
                         f"got {type(targets).__name__}")
    if hidden.device != weight.device or targets.device != hidden.device:
        raise ValueError(f"fused_logprobs: tensors on different devices: {hidden.device}, {weight.device}, "
                         f"{targets.device}")
    if tuple(targets.shape) != lead or targets.dtype.is_floating_point or targets.dtype.is_complex \
            or targets.dtype == torch.bool:
        raise ValueError(f"fused_logprobs: targets must be an integer tensor of shape {lead} (hidden's leading dims), "
                         f"got {targets.dtype} {tuple(targets.shape)}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (V,) or bias.dtype != weight.dtype \
                or bias.device != weight.device:
            raise ValueError(f"fused_logprobs: bias must be a [{V}] tensor of weight's dtype {weight.dtype} on "
                             f"{weight.device}, got {getattr(bias, 'dtype', type(bias))} "
                             f"{tuple(getattr(bias, 'shape', ()))}")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise ValueError(f"fused_logprobs: ignore_index must be an int or None, got {ignore_index!r}")
    for name, size in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"fused_logprobs: chunk sizes must be None or integers >= 1, got {name}={size!r}")
    targets = targets.reshape(-1).long()
    in_vocab = (targets >= 0) & (targets < V)
    valid = None
    if ignore_index is not None:
        valid = targets != ignore_index
        in_vocab = in_vocab | ~valid
    ignored = "" if ignore_index is None else f" (or ignore_index={ignore_index})"
    check_values(in_vocab.all(), f"fused_logprobs: targets must lie in [0, {V}){ignored}",
                 lambda: f"got range [{int(targets.min())}, {int(targets.max())}]")
    inv_temp, unit_temp = _inv_temperature(temperature, lead, hidden.device)
    name = resolve_backend("fused_logprobs", backend, hidden.device, supported=("torch", "triton"),
                           preference=("triton", "torch"))
    h2 = hidden.reshape(-1, D)
    T = h2.shape[0]
    if bias is not None:  # z = [h, 1] . [W, b]
        h2 = torch.cat([h2, h2.new_ones(T, 1)], dim=1)
        weight = torch.cat([weight, bias.unsqueeze(1)], dim=1)
    safe_targets = targets if valid is None else torch.where(valid, targets, torch.zeros_like(targets))
    logprobs, entropy, _, _, _ = fused_logprobs_fwd(
        h2.contiguous(), weight.contiguous(), safe_targets.contiguous(), inv_temp, unit_temp, chunk_size or 0,
        vocab_chunk_size or 0, bool(return_entropy), name)
    if valid is not None:  # 0 and no gradient at the ignored targets
        logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))
        entropy = torch.where(valid, entropy, torch.zeros_like(entropy))
    logprobs = logprobs.view(lead)
    return logprobs, (entropy.view(lead) if return_entropy else None)
