"""Fixtures of the model tests (the builders live in models_testing.py)."""

from __future__ import annotations

import pytest

from models_testing import HF_BUILDERS


@pytest.fixture(scope="session", params=sorted(HF_BUILDERS))
def hf_checkpoint(request, tmp_path_factory):
    """(family, hf_model, checkpoint_dir) for each family, saved with Hugging Face's save_pretrained."""
    family = request.param
    model = HF_BUILDERS[family]()
    path = tmp_path_factory.mktemp(family)
    model.save_pretrained(path)
    return family, model, path
