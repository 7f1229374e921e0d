"""Hugging Face ``transformers`` integration: a ``PretrainedConfig`` / ``PreTrainedModel`` pair
around MoETransformer, registered with the Auto classes, so that a checkpoint saved this way
loads back with ``AutoModelForCausalLM.from_pretrained(path)``.

    from primerl.models.integrations.transformers import PrimerlMoeForCausalLM, register
    register()
    hf_model = PrimerlMoeForCausalLM.from_config(MoETransformerConfig.tiny(vocab_size=100))
    hf_model.save_pretrained(path)
    again = AutoModelForCausalLM.from_pretrained(path)      # a PrimerlMoeForCausalLM

Checkpoints of the Qwen3-MoE / GLM-4.5-MoE families themselves need none of this: they load with
``MoETransformer.from_pretrained`` and ours load into transformers' own classes.
"""

from __future__ import annotations

import dataclasses

import torch

try:
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput
except ImportError as exc:  # ModuleNotFoundError included
    raise ImportError(f"primerl.models.integrations.transformers needs Hugging Face transformers (>= 5.0): "
                      f"pip install 'primerl[hf]' ({exc})") from exc

from ..config import MoETransformerConfig
from ..transformer import MoETransformer

MODEL_TYPE = "primerl_moe"
_FIELDS = [f.name for f in dataclasses.fields(MoETransformerConfig) if f.name != "hf_extra"]


class PrimerlMoeConfig(PretrainedConfig):
    """``transformers`` view of a :class:`MoETransformerConfig` (its fields under ``primerl``)."""

    model_type = MODEL_TYPE

    def __init__(self, primerl: dict | None = None, **kwargs):
        self.primerl = dict(primerl or {})
        super().__init__(**kwargs)

    def to_primerl(self) -> MoETransformerConfig:
        fields = {k: v for k, v in self.primerl.items() if k in _FIELDS}
        if "dense_layers" in fields:
            fields["dense_layers"] = tuple(fields["dense_layers"])
        return MoETransformerConfig(**fields)

    @classmethod
    def from_primerl(cls, config: MoETransformerConfig, **kwargs) -> "PrimerlMoeConfig":
        fields = {k: getattr(config, k) for k in _FIELDS}
        fields["dense_layers"] = list(fields["dense_layers"])
        return cls(primerl=fields, vocab_size=config.vocab_size, hidden_size=config.dim,
                   num_hidden_layers=config.n_layers, tie_word_embeddings=config.tie_word_embeddings, **kwargs)


class PrimerlMoeForCausalLM(PreTrainedModel):
    """``forward(input_ids[B, S], attention_mask=None, labels=None)``: rows are packed as separate
    sequences (right padding given by ``attention_mask`` is dropped, its logits are zero)."""

    config_class = PrimerlMoeConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]

    def __init__(self, config: PrimerlMoeConfig):
        super().__init__(config)
        self.model = MoETransformer(config.to_primerl())
        if config.tie_word_embeddings:
            self._tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}
        self.post_init()

    @classmethod
    def from_config(cls, config: MoETransformerConfig | PrimerlMoeConfig, **kwargs) -> "PrimerlMoeForCausalLM":
        if isinstance(config, MoETransformerConfig):
            config = PrimerlMoeConfig.from_primerl(config)
        return cls(config, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        if module is self.model:
            module.init_weights()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutput:
        B, S = input_ids.shape
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        lengths = mask.sum(1)
        if not torch.equal(mask, torch.arange(S, device=mask.device)[None, :] < lengths[:, None]):
            raise ValueError("PrimerlMoeForCausalLM: attention_mask must be right padding (ones then zeros)")
        cu = torch.zeros(B + 1, dtype=torch.int32, device=input_ids.device)
        cu[1:] = lengths.cumsum(0)
        pos = torch.arange(S, device=input_ids.device).expand(B, S)[mask]
        packed = self.model(input_ids[mask], pos, cu, return_logits=True)
        logits = packed.new_zeros(B, S, packed.shape[-1])
        logits[mask] = packed
        loss = None
        if labels is not None:
            shift = labels[:, 1:].masked_fill(~mask[:, 1:], -100)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                     shift.reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)


def register() -> None:
    """Register the pair with AutoConfig / AutoModelForCausalLM (idempotent)."""
    try:
        AutoConfig.register(MODEL_TYPE, PrimerlMoeConfig)
    except ValueError:  # already registered
        pass
    try:
        AutoModelForCausalLM.register(PrimerlMoeConfig, PrimerlMoeForCausalLM)
    except ValueError:
        pass
