"""The specification of fused_logprobs: full float32 logits, then log-softmax.

Shapes: T tokens, D hidden size, V vocabulary.

    z[t, v]   = (hidden[t] . weight[v]) / temperature[t]         (float32)
    lse[t]    = log sum_v exp(z[t, v])
    logp[t]   = z[t, targets[t]] - lse[t]
    H[t]      = -sum_v p[t, v] log p[t, v],  p = softmax(z[t])

Computed in float32 (float64 when the inputs are float64: the tests' oracle). This materialises
the [T, V] logits (4*T*V bytes, 2 GiB at T=8192, V=65536); it is the oracle for
the chunked paths and the baseline of ``python -m bench logprobs``.
"""

from __future__ import annotations

import torch


def logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [T, D], weight [V, D], targets [T] int, temperature scalar or [T] ->
    (logprobs [T] float32 (float64 for float64 inputs), entropy [T] or None);
    differentiable w.r.t. hidden and weight."""
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    logits = hidden.to(dtype) @ weight.to(dtype).t()
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 1:
        logits = logits / temperature.to(dtype).unsqueeze(1)
    else:
        logits = logits / float(temperature)
    logp_all = torch.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(1, targets.long().unsqueeze(1)).squeeze(1)
    entropy = None
    if return_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logprobs, entropy
