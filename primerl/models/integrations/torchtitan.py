"""torchtitan integration: run torchtitan's MoE grouped experts on primerl's grouped GEMMs.

torchtitan (0.3) routes every expert matmul of ``GroupedExperts`` and its subclasses (fused
SwiGLU experts, GPT-OSS experts) through one method, ``_grouped_mm(*, A[R, K], B_t[E, K, N],
offs[E])`` (``offs`` int32 cumulative end rows), the seam its own low-precision converters
override. :func:`swap_torchtitan_grouped_experts` switches built modules in place to a subclass
whose ``_grouped_mm`` calls

* ``recipe="bf16"``: :func:`primerl.kernels.gemm.grouped_gemm_nt` (same precision as torchtitan's
  ``torch._grouped_mm``, any dims);
* ``recipe="blockwise"`` / ``"blockwise_fp8_wgrad"``:
  :func:`primerl.kernels.fp8_training.fp8_grouped_linear` (DeepSeek-V3 blockwise FP8; expert dims
  must be multiples of 128).

    from primerl.models.integrations.torchtitan import swap_torchtitan_grouped_experts
    model = model_config.build(); model.init_states()
    swap_torchtitan_grouped_experts(model, recipe="blockwise")   # before FSDP / compile

Only the class changes: parameters, hooks, state-dict keys and optimizer state are untouched, and
:func:`restore_torchtitan_grouped_experts` switches back. torchtitan is imported only when one of
these functions runs (install: ``pip install --no-deps torchtitan==0.3.0`` plus its pure-Python
needs, see the error message); importing this module does not need it.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

RECIPES = ("bf16", "blockwise", "blockwise_fp8_wgrad")
_FP8_BLOCK = 128
_INSTALL_HINT = ("pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro torch_checkpointing "
                 "docstring-parser typeguard  (plus einops and safetensors; --no-deps keeps pip from "
                 "replacing your torch)")

__all__ = ["RECIPES", "swap_torchtitan_grouped_experts", "restore_torchtitan_grouped_experts",
           "is_primerl_grouped_experts"]


def _grouped_experts_base() -> type:
    try:
        from torchtitan.models.common.moe import GroupedExperts
    except ImportError as e:
        raise ImportError(f"primerl's torchtitan integration needs torchtitan (0.3): {_INSTALL_HINT}. "
                          f"Import failed with: {e}") from e
    return GroupedExperts


class _PrimerlGroupedMM:
    """Mixin placed before a torchtitan experts class: overrides its ``_grouped_mm`` seam."""

    primerl_recipe: str = "blockwise"
    primerl_backend: str | None = None

    def _grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        # A [R, K] @ B_t[e] [K, N] for the rows of expert e; primerl's GEMMs take B as [E, N, K]
        weight = B_t.transpose(-2, -1)
        if self.primerl_recipe == "bf16":
            from primerl.kernels.gemm import grouped_gemm_nt

            return grouped_gemm_nt(A, weight, offs, layout="offsets", backend=self.primerl_backend)
        from primerl.kernels.fp8_training import fp8_grouped_linear

        return fp8_grouped_linear(A, weight, offs, recipe=self.primerl_recipe, backend=self.primerl_backend)

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base + ', ' if base else ''}primerl_recipe={self.primerl_recipe!r}"


_SUBCLASSES: dict[type, type] = {}


def _primerl_class(parent: type) -> type:
    """The cached subclass ``Primerl<parent>`` of a torchtitan experts class."""
    cls = _SUBCLASSES.get(parent)
    if cls is None:
        # no Config of its own: torchtitan's Config._owner (what config.build() makes) stays parent
        cls = type(f"Primerl{parent.__name__}", (_PrimerlGroupedMM, parent), {"__module__": __name__})
        _SUBCLASSES[parent] = cls
    return cls


def is_primerl_grouped_experts(module: nn.Module) -> bool:
    """True for a torchtitan experts module switched by :func:`swap_torchtitan_grouped_experts`."""
    return isinstance(module, _PrimerlGroupedMM)


def _check_fp8_dims(fqn: str, module: nn.Module, recipe: str) -> None:
    """Expert weights are [E, N, K] (or fused [E, F, 2, K]): N and K must be multiples of 128."""
    for name, p in module.named_parameters(recurse=False):
        if p.dim() < 3:
            continue  # biases [E, N] are added outside the grouped GEMM
        n, k = math.prod(p.shape[1:-1]), p.shape[-1]
        if n % _FP8_BLOCK or k % _FP8_BLOCK:
            raise ValueError(
                f"swap_torchtitan_grouped_experts: {fqn or '<root>'}.{name} has shape {tuple(p.shape)}; "
                f"recipe={recipe!r} needs expert out/in dims ({n}, {k}) to be multiples of {_FP8_BLOCK}. "
                "Use recipe='bf16' or exclude the module with filter_fn.")


def swap_torchtitan_grouped_experts(model: nn.Module, recipe: str = "blockwise", *, backend: str | None = None,
                                    filter_fn: Callable[[str, nn.Module], bool] | None = None) -> list[str]:
    """Make torchtitan's grouped-experts modules in ``model`` compute with primerl's grouped GEMMs.

    Every module that is a torchtitan ``GroupedExperts`` (or subclass) and passes
    ``filter_fn(fqn, module)`` (all when None) is switched in place; one already switched gets the
    new ``recipe`` / ``backend``. ``recipe``: one of :data:`RECIPES` (see module doc); ``backend``
    is passed to the primerl op (None picks). All modules are checked before any changes (FP8
    recipes raise ``ValueError`` naming a weight whose dims are not multiples of 128). Swap
    before wrapping with FSDP / ``torch.compile``. Returns the fully qualified names switched.
    """
    if recipe not in RECIPES:
        raise ValueError(f"swap_torchtitan_grouped_experts: recipe must be one of {RECIPES}, got {recipe!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"swap_torchtitan_grouped_experts: model must be an nn.Module, got {type(model).__name__}")
    base = _grouped_experts_base()
    chosen = [(fqn, m) for fqn, m in model.named_modules()
              if isinstance(m, base) and (filter_fn is None or filter_fn(fqn, m))]
    if recipe != "bf16":
        for fqn, module in chosen:
            _check_fp8_dims(fqn, module, recipe)
    for _, module in chosen:
        if not isinstance(module, _PrimerlGroupedMM):
            module.__class__ = _primerl_class(type(module))
        module.primerl_recipe = recipe
        module.primerl_backend = backend
    return [fqn for fqn, _ in chosen]


def restore_torchtitan_grouped_experts(model: nn.Module) -> list[str]:
    """Undo :func:`swap_torchtitan_grouped_experts` in place; returns the names restored."""
    restored = []
    for fqn, module in model.named_modules():
        if isinstance(module, _PrimerlGroupedMM):
            module.__class__ = next(p for p, c in _SUBCLASSES.items() if c is type(module))
            for attr in ("primerl_recipe", "primerl_backend"):
                module.__dict__.pop(attr, None)
            restored.append(fqn)
    return restored
