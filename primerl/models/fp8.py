"""convert_to_fp8(model, recipe): run a MoETransformer's linears and grouped experts in FP8.

Delegates to the GEMM layer's module swap (``primerl.kernels.fp8_training.convert_to_fp8``); this
entry point only chooses what to convert. The default keeps in high precision what FP8 recipes
keep there everywhere: the embedding, the output head (its logits feed log-probabilities that RL
ratios are sensitive to), the routers (selection decisions) and the norms; for MLA models the
sparse-attention indexer (frozen; a selection decision too) and ``kv_b_proj`` (the absorbed form
uses its weight as a matrix); and it skips any matrix whose dims are not multiples of 128 (the
block size of the blockwise recipes).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

FP8_BLOCK = 128


def default_fp8_filter(name: str, module: nn.Module) -> bool:
    """True for the modules to convert: ``nn.Linear`` inside the decoder layers (attention
    projections, dense and shared-expert MLPs) and the grouped experts, with 128-multiple dims."""
    if not name.startswith("layers."):
        return False  # embedding, final norm, lm_head
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "gate":  # the router
        return False
    if ".indexer." in name or leaf == "kv_b_proj":
        # MLA: the sparse-attention indexer is frozen and makes a discrete choice (as the router);
        # kv_b_proj's weight is also read directly by the absorbed sparse form (W_uk / W_uv)
        return False
    if isinstance(module, nn.Linear):
        shape = module.weight.shape
    elif leaf == "experts" and hasattr(module, "w13"):
        shape = module.w13.shape[1:] + module.w2.shape[1:]
    else:
        return False
    return all(int(s) % FP8_BLOCK == 0 for s in shape)


def convert_to_fp8(model: nn.Module, recipe: str = "blockwise",
                   filter_fn: Callable[[str, nn.Module], bool] | None = None) -> nn.Module:
    """Swap ``model``'s selected linears and grouped experts for FP8 versions in place; returns it.

    ``recipe``: a recipe name of ``primerl.kernels.fp8_training`` (``"blockwise"``,
    ``"blockwise_fp8_wgrad"``, ``"rowwise"``). ``filter_fn(name, module)``: which modules to convert
    (default :func:`default_fp8_filter`). Call it before :func:`primerl.models.parallelize`
    (FSDP wraps the modules as they are then).
    """
    try:
        from primerl.kernels.fp8_training import convert_to_fp8 as _convert
    except ImportError as e:
        raise RuntimeError("convert_to_fp8 needs primerl.kernels.fp8_training (the FP8 GEMM layer), "
                           f"which is not available: {e}") from e
    return _convert(model, recipe, filter_fn or default_fp8_filter)
