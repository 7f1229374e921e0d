"""primerl.models.convert_to_fp8 and primerl.kernels.fp8_training.convert_to_fp8: one behaviour
(incompatible dims kept in high precision, or ValueError with incompatible="raise"), and both
report what they converted and what they kept and why (model.fp8_conversion)."""

from __future__ import annotations

import copy

import pytest
from torch import nn

from primerl.kernels.fp8_training import convert_to_fp8 as kernels_convert
from primerl.models import MoETransformer, MoETransformerConfig
from primerl.models.fp8 import convert_to_fp8, default_fp8_filter


def test_tiny_model_reports_every_candidate_kept_with_its_reason():
    model = MoETransformer(MoETransformerConfig.tiny())  # d=64: nothing 128-aligned
    convert_to_fp8(model)
    report = model.fp8_conversion
    assert report.converted == []
    candidates = [n for n, m in model.named_modules() if type(m) is nn.Linear or hasattr(m, "enable_fp8")]
    assert set(report.kept) >= {n for n in candidates if not any(n.startswith(o + ".") for o in report.kept)}
    assert "multiples of 128" in report.kept["layers.0.attention.q_proj"]
    assert "lm_head" in report.kept["lm_head"]
    assert "kept in high precision" in str(report)
    with pytest.raises(ValueError, match="multiples of 128"):
        convert_to_fp8(copy.deepcopy(model), filter_fn=lambda n, m: n.startswith("layers."), incompatible="raise")


def test_models_and_kernels_conversions_agree():
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 100))
    a = convert_to_fp8(copy.deepcopy(model), filter_fn=lambda n, m: True)
    b = kernels_convert(copy.deepcopy(model))
    assert a.fp8_conversion == b.fp8_conversion
    assert a.fp8_conversion.converted == ["0"] and list(a.fp8_conversion.kept) == ["1"]
    assert default_fp8_filter("layers.0.mlp.up", nn.Linear(128, 256))
