"""Packaging for library users: py.typed shipped, ``__all__`` of the public packages complete and
resolvable, the optional transformers integration failing with the install hint."""

import importlib
import pathlib
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ["primerl.kernels", "primerl.models", "primerl.parallel", "primerl.rl"]


def test_py_typed_is_shipped():
    import primerl

    assert (pathlib.Path(primerl.__file__).parent / "py.typed").is_file()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("tomllib needs Python >= 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["primerl"]
    assert any("transformers" in dep for dep in project["project"]["optional-dependencies"]["hf"])


@pytest.mark.parametrize("name", PACKAGES)
def test_all_lists_every_public_name_and_resolves(name):
    mod = importlib.import_module(name)
    assert isinstance(mod.__all__, list) and len(set(mod.__all__)) == len(mod.__all__)
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{name}.__all__ names what the package does not have: {missing}"
    # every public function, class or constant the package itself binds (not a submodule it
    # merely imported) is in __all__
    public = {n for n, v in vars(mod).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)
              and (getattr(v, "__module__", "") or "").startswith("primerl")}
    assert public <= set(mod.__all__), f"{name}: public names missing from __all__: {sorted(public - set(mod.__all__))}"
    namespace: dict = {}
    exec(f"from {name} import *", namespace)
    assert set(mod.__all__) <= set(namespace)


def test_transformers_integration_without_transformers_says_how_to_install():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n"
            "    import primerl.models.integrations.transformers\n"
            "except ImportError as e:\n"
            "    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ImportError") and "pip install 'primerl[hf]'" in out.stdout, out.stdout
