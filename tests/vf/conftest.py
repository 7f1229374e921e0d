"""Tests that run the real verifiers 0.4.0 (and its ``renderers``) against primerl.

They need an interpreter with ``verifiers`` installed (``.venv-vf``, made as ``.ci/run`` does; see
docs/verifiers.md). In one without it this folder is not collected; ``tests/runtime/
test_verifiers_suite.py`` then runs this folder in ``PRIMERL_VF_PYTHON`` (or ``<repo>/.venv-vf``), and with
``PRIMERL_REQUIRE_VERIFIERS=1`` (CI) a missing interpreter fails instead of skipping.

Run directly: ``.venv-vf/bin/python -m pytest tests/vf`` (with ``PYTHONPATH`` at the checkout).
"""

import importlib.util

HAVE_VERIFIERS = (importlib.util.find_spec("verifiers") is not None
                  and importlib.util.find_spec("verifiers.v1") is not None)


def pytest_ignore_collect(collection_path, config):
    if not HAVE_VERIFIERS and collection_path.name.startswith("test_"):
        return True
    return None
