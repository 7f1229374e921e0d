"""Tests that run the real verifiers 0.4.0 (and its ``renderers``) against primerl.

They need an interpreter with ``verifiers`` installed (``.venv-vf``, made as ``.ci/run`` does; see
README "verifiers"). In one without it this folder is not collected; ``tests/runtime/
test_verifiers_suite.py`` then runs it in ``PRIMERL_VF_PYTHON`` (or ``<repo>/.venv-vf``), and with
``PRIMERL_REQUIRE_VERIFIERS=1`` (CI) a missing interpreter fails instead of skipping.
"""

import importlib.util

if importlib.util.find_spec("verifiers") is None:
    collect_ignore_glob = ["test_*.py"]
