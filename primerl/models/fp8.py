"""convert_to_fp8(model, recipe): run a MoETransformer's linears and grouped experts in FP8.

Delegates to the GEMM layer's module swap (``primerl.kernels.fp8_training.convert_to_fp8``); this
entry point only chooses what to convert. The default keeps in high precision what FP8 recipes
keep there everywhere: the embedding, the output head (its logits feed log-probabilities that RL
ratios are sensitive to), the routers (selection decisions) and the norms; for MLA models the
sparse-attention indexer (frozen; a selection decision too) and ``kv_b_proj`` (the absorbed form
uses its weight as a matrix); and it skips any matrix whose dims are not multiples of 128 (the
block size of the blockwise recipes). ``model.fp8_conversion`` reports what was converted and what
was kept and why.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

FP8_BLOCK = 128


def fp8_exclusion_reason(name: str, module: nn.Module) -> str | None:
    """Why the default filter keeps ``module`` in high precision, or None when it converts it."""
    if not name.startswith("layers."):
        return "outside the decoder layers (embedding, final norm, lm_head: logits feed RL ratios)"
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "gate":
        return "the router (a selection decision)"
    if ".indexer." in name or leaf == "kv_b_proj":
        # MLA: the sparse-attention indexer is frozen and makes a discrete choice (as the router);
        # kv_b_proj's weight is also read directly by the absorbed sparse form (W_uk / W_uv)
        return "MLA indexer / kv_b_proj (a selection decision / read as a matrix by the absorbed form)"
    if isinstance(module, nn.Linear):
        shape = tuple(module.weight.shape)
    elif leaf == "experts" and hasattr(module, "w13"):
        shape = tuple(module.w13.shape[1:] + module.w2.shape[1:])
    else:
        return "not a linear or grouped experts"
    if any(int(s) % FP8_BLOCK for s in shape):
        return f"dims {shape} not all multiples of {FP8_BLOCK} (the FP8 block)"
    return None


def default_fp8_filter(name: str, module: nn.Module) -> bool:
    """True for the modules to convert: ``nn.Linear`` inside the decoder layers (attention
    projections, dense and shared-expert MLPs) and the grouped experts, with 128-multiple dims."""
    return fp8_exclusion_reason(name, module) is None


def convert_to_fp8(model: nn.Module, recipe: str = "blockwise",
                   filter_fn: Callable[[str, nn.Module], bool] | None = None, *,
                   incompatible: str = "skip") -> nn.Module:
    """Swap ``model``'s selected linears and grouped experts for FP8 versions in place; returns it.

    ``recipe``: a recipe name of ``primerl.kernels.fp8_training`` (``"blockwise"``,
    ``"blockwise_fp8_wgrad"``, ``"rowwise"``). ``filter_fn(name, module)``: which modules to convert
    (default :func:`default_fp8_filter`). Same behaviour as
    :func:`primerl.kernels.fp8_training.convert_to_fp8` (which it calls): modules whose dims are not
    multiples of 128 stay in high precision (``incompatible="raise"``: a ValueError instead), and
    ``model.fp8_conversion`` reports what was converted and what was kept and why (with the default
    filter, its reason: :func:`fp8_exclusion_reason`). Call it before
    :func:`primerl.models.parallelize` (FSDP wraps the modules as they are then).
    """
    try:
        from primerl.kernels.fp8_training import convert_to_fp8 as _convert
    except ImportError as e:
        raise RuntimeError("convert_to_fp8 needs primerl.kernels.fp8_training (the FP8 GEMM layer), "
                           f"which is not available: {e}") from e
    model = _convert(model, recipe, filter_fn or default_fp8_filter, incompatible=incompatible)
    if filter_fn is None:
        modules = dict(model.named_modules())
        report = model.fp8_conversion
        for name, why in list(report.kept.items()):
            if why == "excluded by filter_fn":
                report.kept[name] = fp8_exclusion_reason(name, modules["" if name == "<root>" else name]) or why
    return model
