"""The MoE transformer family and Hugging Face checkpoint I/O, built on the layers below."""

from .config import MoETransformerConfig, UnsupportedCheckpointError  # noqa: F401
from .checkpoint import CheckpointError  # noqa: F401
from .transformer import MoETransformer  # noqa: F401
from .parallelize import parallelize  # noqa: F401
from .fp8 import convert_to_fp8  # noqa: F401
from .lora import LoRAError, apply_lora, merge_lora, unmerge_lora  # noqa: F401
from .lora_io import load_lora, save_lora  # noqa: F401

__all__ = ["MoETransformerConfig", "UnsupportedCheckpointError", "CheckpointError", "MoETransformer", "parallelize",
           "convert_to_fp8", "LoRAError", "apply_lora", "merge_lora", "unmerge_lora", "save_lora", "load_lora"]
