"""``[model]``: the policy, a local Hugging Face directory or a random init of
``primerl.models.MoETransformerConfig``, and the section's own checks.

The random init's fields are the model's: their names and defaults are read from
``MoETransformerConfig`` (one source), so a default changed there is the job's default too.
The section adds what only the job knows: ``path`` (a checkpoint instead of a random init),
``vocab_size = 0`` (the environment's) and ``extra`` (any other ``MoETransformerConfig`` field).
The model's own ``validate`` (shapes, heads, rope) runs when ``primerl.runtime.validate`` builds
the config through ``policy.model_config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from primerl.models.config import MoETransformerConfig

from .errors import _need

_MODEL = {f.name: f.default for f in dataclasses.fields(MoETransformerConfig)}

# the MoETransformerConfig fields that are keys of [model] (every other field goes through model.extra)
MODEL_FIELDS = ("family", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "moe_dim", "num_experts", "top_k",
                "max_position_embeddings", "rope_theta", "dtype")
DTYPES = ("float32", "bfloat16")


@dataclass
class ModelConfig:
    """The policy: a local Hugging Face directory, or a random init from these fields (names and
    defaults as in ``primerl.models.MoETransformerConfig``; ``extra`` passes any other field of it)."""

    path: str = ""
    family: str = _MODEL["family"]
    vocab_size: int = 0  # 0: the environment's vocab_size
    dim: int = _MODEL["dim"]
    n_layers: int = _MODEL["n_layers"]
    n_heads: int = _MODEL["n_heads"]
    n_kv_heads: int = _MODEL["n_kv_heads"]
    head_dim: int = _MODEL["head_dim"]
    moe_dim: int = _MODEL["moe_dim"]
    num_experts: int = _MODEL["num_experts"]
    top_k: int = _MODEL["top_k"]
    max_position_embeddings: int = _MODEL["max_position_embeddings"]
    rope_theta: float = _MODEL["rope_theta"]  # rotary base; short sequences want a small one (reverse_text.toml)
    dtype: str = _MODEL["dtype"]
    extra: dict = field(default_factory=dict)

    def model_kwargs(self) -> dict:
        """The ``MoETransformerConfig`` keyword arguments of this section's fields (``vocab_size``
        and ``extra`` not included: the caller resolves 0 to the environment's and passes ``extra``
        beside these, so a field given twice is a TypeError)."""
        return {k: getattr(self, k) for k in MODEL_FIELDS}


def check_model(m: ModelConfig) -> None:
    """``[model]``'s own ranges and choices."""
    _need(m.dtype in DTYPES, "model.dtype", "must be float32 or bfloat16", m.dtype)
    _need(m.top_k >= 1 and m.top_k <= m.num_experts, "model.top_k", f"must be in [1, num_experts={m.num_experts}]",
          m.top_k)


def check_model_path(m: ModelConfig) -> None:
    """``model.path`` is a Hugging Face checkpoint directory (looked at now, so ``--dry-run`` fails)."""
    if m.path:
        _need(Path(m.path).is_dir(), "model.path", "must be an existing directory (a Hugging Face checkpoint)", m.path)
        _need((Path(m.path) / "config.json").is_file(), "model.path", "has no config.json (not a Hugging Face "
              "checkpoint directory)", m.path)
