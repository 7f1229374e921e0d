"""Build the policy model from the job config (random init or a local Hugging Face checkpoint)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from primerl.models.config import MoETransformerConfig

from .config import ConfigError, RLConfig

if TYPE_CHECKING:  # the model's configuration is all the launcher needs: it does not load torch
    import torch

    from primerl.models.transformer import MoETransformer


def model_config(cfg: RLConfig, vocab_size: int) -> MoETransformerConfig:
    m = cfg.model
    if m.path:
        mc = MoETransformerConfig.from_hf(m.path)
        if mc.vocab_size < vocab_size:
            raise ConfigError(f"model.path: the checkpoint's vocab_size {mc.vocab_size} is smaller than the "
                              f"environment's {vocab_size}")
        return mc
    vocab = m.vocab_size or vocab_size
    if vocab < vocab_size:
        raise ConfigError(f"model.vocab_size: must be >= the environment's vocab_size {vocab_size}, got {vocab}")
    try:
        return MoETransformerConfig(vocab_size=vocab, **m.model_kwargs(), **m.extra)
    except TypeError as e:
        raise ConfigError(f"model.extra: {e}") from None
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


def base_model_name(cfg: RLConfig) -> str:
    """The base a LoRA run adapts (``trainer.lora``): ``model.path``, or the seeded random init of ``[model]``."""
    return cfg.model.path or f"random init of [model] (seed {cfg.seed})"


def build_model(cfg: RLConfig, vocab_size: int, *, device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None) -> MoETransformer:
    """The same weights in every process: random init seeded by ``cfg.seed`` (drawn on the CPU, so
    every device starts from the same numbers), or the checkpoint; then moved to ``device`` in
    ``dtype`` (default ``model.dtype``)."""
    import torch

    from primerl.models.transformer import MoETransformer

    dtype = dtype or getattr(torch, cfg.model.dtype)
    if cfg.model.path:
        return MoETransformer.from_pretrained(cfg.model.path, dtype=dtype).to(device)
    mc = model_config(cfg, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = MoETransformer(mc)
        model.init_weights(seed=cfg.seed)
    return model.to(device=device, dtype=dtype)
