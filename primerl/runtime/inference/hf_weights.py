"""Published weights in the Hugging Face layout (what vLLM's ``load_weights`` reads) and back.

The name mapping is ``primerl.models.checkpoint.hf_layout`` (the one ``save_pretrained`` and
``from_pretrained`` use): every Hugging Face tensor name -> a slice of one model parameter.

- :func:`hf_weights`: a primerl state dict (full, unsharded) -> ``{hf_name: tensor}``.
- :func:`primerl_weights`: ``{hf_name: tensor}`` (FP8 ``<name>`` + ``<name>_scale_inv`` block-scaled
  tensors are dequantized) -> a primerl state dict for ``model.load_state_dict``.
- :func:`hf_stream`: the same renaming and slicing for a stream of ``(name, tensor)`` (the
  trainer's gather, one tensor at a time), with the Hugging Face specs computed up front.
- :func:`publish_hf`: write one version through a :class:`FileTransport` as
  ``model.safetensors`` + ``config.json`` + the ``STABLE`` marker, optionally with the expert
  weights re-quantized to block FP8 for the transfer (``quantize_for_transfer``).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from primerl.models.checkpoint import hf_layout

SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = (128, 128)


def _expert_format(model, expert_format: str | None) -> str:
    return expert_format or getattr(model, "_expert_format", "unfused")


def _tensors_of(model, state_dict: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(dict(model.named_buffers()))
    if state_dict is None:
        return own
    return {**own, **state_dict}  # buffers a state dict leaves out (non-persistent) come from the model


def hf_weights(model, state_dict: dict[str, torch.Tensor] | None = None, *,
               expert_format: str | None = None) -> dict[str, torch.Tensor]:
    """``state_dict`` (primerl names; default: the model's own tensors) in ``model``'s Hugging Face
    layout, as detached contiguous CPU tensors. ``model`` only supplies the structure (it may be
    FSDP-sharded while ``state_dict`` is the gathered full state)."""
    layout = hf_layout(model, _expert_format(model, expert_format))
    tensors = _tensors_of(model, state_dict)
    out = {}
    for key, slot in layout.items():
        t = tensors[slot.param]
        if hasattr(t, "full_tensor"):
            raise ValueError(f"hf_weights: {slot.param} is sharded (DTensor); pass the gathered full state_dict")
        t = t.detach()
        out[key] = (t[slot.index] if slot.index else t).to("cpu").contiguous()
    return out


def hf_stream(model, specs: list, stream: Iterable[tuple[str, torch.Tensor | None]], *,
              expert_format: str | None = None) -> tuple[list, Iterator[tuple[str, torch.Tensor | None]]]:
    """``(hf_specs, hf_stream)``: ``stream`` (primerl names, in the order of ``specs`` =
    ``[(name, dtype, global shape)]``) renamed and sliced into ``model``'s Hugging Face layout as the
    tensors arrive; ``hf_specs`` are known before any tensor (from the shapes alone). ``None``
    tensors (the ranks that do not receive) stay ``None``."""
    slots: dict[str, list] = {}
    for key, slot in hf_layout(model, _expert_format(model, expert_format)).items():
        slots.setdefault(slot.param, []).append((key, slot.index))
    out = []
    for name, dtype, shape in specs:
        meta = torch.empty(shape, dtype=dtype, device="meta")
        out += [(key, dtype, tuple((meta[index] if index else meta).shape)) for key, index in slots.get(name, ())]

    def renamed():
        for name, t in stream:
            for key, index in slots.get(name, ()):
                yield key, (t[index] if index else t) if t is not None else None

    return out, renamed()


def primerl_weights(model, tensors: dict[str, torch.Tensor], *,
                    expert_format: str | None = None) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_weights` for ``model``: a full primerl state dict (float tensors in
    the model's dtypes). FP8 tensors with a ``<name>_scale_inv`` are dequantized (128x128 blocks).
    Raises ``ValueError`` naming missing or unexpected tensors."""
    from primerl.kernels.fp8 import dequant

    fmt = expert_format or ("fused" if any(k.endswith("experts.gate_up_proj") for k in tensors) else "unfused")
    layout = hf_layout(model, fmt)
    names = {k for k in tensors if not k.endswith(SCALE_SUFFIX)}
    missing, unexpected = sorted(set(layout) - names), sorted(names - set(layout))
    if missing or unexpected:
        raise ValueError(f"weights do not match the model's Hugging Face layout: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key, slot in layout.items():
        t = tensors[key]
        if key + SCALE_SUFFIX in tensors:
            t = dequant(t, tensors[key + SCALE_SUFFIX], group_shape=FP8_BLOCK, out_dtype=torch.float32)
        target = out[slot.param]
        dst = target[slot.index] if slot.index else target
        if tuple(dst.shape) != tuple(t.shape):
            raise ValueError(f"{key}: shape {tuple(t.shape)}, the model expects {tuple(dst.shape)}")
        dst.copy_(t)
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in out:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def publish_hf(transport, version: int, model, state_dict: dict[str, torch.Tensor] | None = None, *,
               fp8: bool = False, expert_format: str | None = None):
    """Publish ``state_dict`` as version ``version`` in the Hugging Face layout (a directory that
    ``MoETransformer.from_pretrained`` and, without ``fp8``, ``transformers`` load). With ``fp8``,
    expert weights are block-FP8 (``<name>`` e4m3 + ``<name>_scale_inv``), the layout of a
    block-FP8 checkpoint. Returns the directory."""
    from .vllm_client import quantize_for_transfer

    tensors = hf_weights(model, state_dict, expert_format=expert_format)
    if fp8:
        tensors = quantize_for_transfer(tensors, block=FP8_BLOCK)
    return transport.publish_weights(version, tensors, config=model.config.to_hf())
