"""The MoE transformer family and Hugging Face checkpoint I/O, built on the layers below."""

from .config import MoETransformerConfig, UnsupportedCheckpointError  # noqa: F401
from .checkpoint import CheckpointError  # noqa: F401
from .transformer import MoETransformer  # noqa: F401
from .parallelize import parallelize  # noqa: F401
from .fp8 import convert_to_fp8  # noqa: F401

__all__ = ["MoETransformerConfig", "UnsupportedCheckpointError", "CheckpointError", "MoETransformer", "parallelize",
           "convert_to_fp8"]
