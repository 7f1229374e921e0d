"""The embedded engine's LoRA adapters (``trainer.lora``): each version arrives as PEFT-keyed
adapter tensors (``weight_channels.LoRAChannel``) and is applied one of two ways
(``trainer.lora.engine``):

- ``"merge"``: on receipt, every adapted weight becomes ``W_base + scale * B @ A`` (the base
  weights of the adapted modules are kept once, so versions never drift); the forward is the plain
  model's. Costs one low-rank product per adapted matrix per update and a copy of those weights.
- ``"forward"``: the engine's model carries the adapters (``primerl.models.apply_lora``) and adds
  the low-rank path in every forward; an update only copies the adapters in.

bench/RESULTS.md (Issue 43) has the two measured on the CPU.
"""

from __future__ import annotations

import torch
from torch import nn

ENGINE_MODES = ("merge", "forward")
_PREFIX = "base_model.model."


def is_adapter_state(state_dict: dict) -> bool:
    """True for PEFT-keyed adapter tensors (every key ``base_model.model.*.lora_{A,B}.weight``)."""
    return bool(state_dict) and all(k.startswith(_PREFIX) and ".lora_" in k for k in state_dict)


class EngineAdapters:
    """Adapters on the engine's ``model`` (rank / alpha / targets as the trainer's), applied by ``mode``."""

    def __init__(self, model: nn.Module, rank: int, alpha: float, targets=None, mode: str = "merge"):
        from primerl.models import apply_lora
        from primerl.models.lora import lora_modules

        if mode not in ENGINE_MODES:
            raise ValueError(f"EngineAdapters: mode must be one of {ENGINE_MODES}, got {mode!r}")
        self.model, self.mode = model, mode
        apply_lora(model, rank, alpha, targets=targets)
        self.modules = lora_modules(model)
        self.base: dict[str, tuple[torch.Tensor, ...]] = {}
        if mode == "merge":  # B starts at zero: the merged weights are the base until the first version
            for name, m in self.modules.items():
                self.base[name] = (m.w13.detach().clone(), m.w2.detach().clone()) if hasattr(m, "w13") \
                    else (m.weight.detach().clone(),)
                m.lora_merged = True

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take one version's adapters (checked by name and shape first) and apply them."""
        from primerl.models.lora import experts_delta
        from primerl.models.lora_io import load_adapter_tensors

        load_adapter_tensors(self.model, tensors, "the LoRA weight update")
        if self.mode != "merge":
            return
        for name, m in self.modules.items():
            if hasattr(m, "w13"):
                d13, d2 = experts_delta(m)
                b13, b2 = self.base[name]
                m.w13.copy_((b13.float() + d13).to(m.w13.dtype))
                m.w2.copy_((b2.float() + d2).to(m.w2.dtype))
            else:
                (b,) = self.base[name]
                m.weight.copy_((b.float() + m.lora_delta()).to(m.weight.dtype))
