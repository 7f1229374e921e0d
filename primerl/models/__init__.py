"""The MoE transformer family and Hugging Face checkpoint I/O, built on the layers below.

The names below are imported from their modules on first access: a process that only reads a
model's configuration (the launcher, ``--dry-run``, ``primerl plan``) does not load torch
(~2.4 CPU-s per process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports as _lazy_exports

_EXPORTS = {
    **dict.fromkeys(("MoETransformerConfig", "UnsupportedCheckpointError"), "config"),
    "CheckpointError": "checkpoint",
    "MoETransformer": "transformer",
    "parallelize": "parallelize",
    "convert_to_fp8": "fp8",
    **dict.fromkeys(("LoRAError", "apply_lora", "merge_lora", "unmerge_lora"), "lora"),
    **dict.fromkeys(("load_lora", "save_lora"), "lora_io"),
}

__all__ = ["MoETransformerConfig", "UnsupportedCheckpointError", "CheckpointError", "MoETransformer", "parallelize",
           "convert_to_fp8", "LoRAError", "apply_lora", "merge_lora", "unmerge_lora", "save_lora", "load_lora"]

if TYPE_CHECKING:
    from .checkpoint import CheckpointError  # noqa: F401
    from .config import MoETransformerConfig, UnsupportedCheckpointError  # noqa: F401
    from .fp8 import convert_to_fp8  # noqa: F401
    from .lora import LoRAError, apply_lora, merge_lora, unmerge_lora  # noqa: F401
    from .lora_io import load_lora, save_lora  # noqa: F401
    from .parallelize import parallelize  # noqa: F401
    from .transformer import MoETransformer  # noqa: F401

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
