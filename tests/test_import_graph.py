"""The package's import graph, read with ``ast`` (module-level and function-level imports alike):
no import cycle anywhere in ``primerl/``, no import up a layer (kernels -> parallel -> rl -> models
-> runtime), and none up a tier inside the runtime (config -> shared modules -> the process rooms
-> launch -> validate -> cli)."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "parallel", "rl", "models", "runtime")
# Tiers of the runtime, by the first name under primerl.runtime (a module or a package); a module
# imports its own tier or those below. Names not listed are the shared modules (policy, placement,
# transport, metrics, lifetime, ...), tier 1: they serve every process and start none.
RUNTIME_TIERS = {"config": 0, "trainer": 2, "inference": 2, "orchestrator": 2, "launch": 3, "validate": 4, "cli": 5}
SHARED_TIER = 1

# Cycles that are genuinely required, each with its reason: (sorted module names) -> reason. Empty.
ALLOWED_CYCLES: dict[tuple[str, ...], str] = {}


def module_files(root: Path, package: str = "primerl") -> dict[str, tuple[Path, bool]]:
    """``{"primerl.runtime.config": (path, is_package), ...}`` for every ``.py`` under ``root/package``."""
    out = {}
    for p in (root / package).rglob("*.py"):
        parts = list(p.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def _targets(mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, mods) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]


def module_edges(mod: str, is_pkg: bool, source: str, mods) -> set[str]:
    """The modules of ``mods`` that module ``mod`` (its text ``source``) imports, anywhere in its
    body; ``if TYPE_CHECKING:`` blocks are skipped, they never run. Importing ``a.b.c`` from outside
    ``a.b`` also runs ``a.b``'s ``__init__``, so that edge is added too."""
    tree = ast.parse(source, mod)
    skip = {id(n) for t in ast.walk(tree) if isinstance(t, ast.If) and "TYPE_CHECKING" in ast.unparse(t.test)
            for s in t.body for n in ast.walk(s)}
    edges = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in skip:
            continue
        for t in _targets(mod, is_pkg, node, mods):
            while t and t not in mods:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            while t and t != mod:
                edges.add(t)
                t = t.rpartition(".")[0]
                if mod == t or mod.startswith(t + "."):  # its own package: already running
                    break
    return {t for t in edges if t in mods}


def import_graph(root: Path, package: str = "primerl") -> dict[str, set[str]]:
    """Edges module -> the modules it imports (:func:`module_edges`), for every module of ``package``."""
    mods = module_files(root, package)
    return {mod: module_edges(mod, is_pkg, path.read_text(), mods) for mod, (path, is_pkg) in mods.items()}


def cycles(graph: dict[str, set[str]], within: str) -> list[list[str]]:
    """Strongly connected components (more than one module) of the graph restricted to ``within``."""
    nodes = [m for m in graph if m == within or m.startswith(within + ".")]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph has a few hundred nodes, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in nodes:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return found


@functools.lru_cache(maxsize=1)
def primerl_graph() -> dict[str, set[str]]:
    return import_graph(ROOT)


def _describe(graph, comp) -> str:
    return "; ".join(f"{a} -> {b}" for a in comp for b in sorted(graph[a] & set(comp)))


def forbidden_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each import cycle in ``primerl`` not in ALLOWED_CYCLES, as its edges."""
    return [_describe(graph, c) for c in cycles(graph, "primerl") if tuple(c) not in ALLOWED_CYCLES]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports up a layer of the package (kernels -> parallel -> rl -> models -> runtime)."""
    bad = []
    for mod, targets in graph.items():
        layer = mod.split(".")[1] if mod.count(".") else None
        for t in targets:
            t_layer = t.split(".")[1] if t.count(".") else None
            if layer in LAYERS and t_layer in LAYERS and LAYERS.index(t_layer) > LAYERS.index(layer):
                bad.append(f"{mod} -> {t}")
    return sorted(bad)


# The doors of the runtime (issue 41): the registries and protocols of the inference backends and
# the launchers. Shared modules (placement, the memory plan, the transport) ask them for a
# backend's or launcher's capabilities, so they sit in the shared tier, and they import nothing of
# their room beyond the lazy package itself (the registry imports the built-in backends / launchers
# by name on first lookup, not by an import statement).
DOORS = {"primerl.runtime.inference.backend", "primerl.runtime.launch.kinds"}


def _runtime_tier(mod: str) -> int | None:
    parts = mod.split(".")
    if len(parts) < 3 or parts[:2] != ["primerl", "runtime"]:
        return None  # outside the runtime, or its package __init__
    if mod in DOORS:
        return SHARED_TIER
    return RUNTIME_TIERS.get(parts[2], SHARED_TIER)


def runtime_tier_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports up a tier inside the runtime (see RUNTIME_TIERS)."""
    bad = []
    for mod, targets in graph.items():
        tier = _runtime_tier(mod)
        for t in targets:
            t_tier = _runtime_tier(t)
            if any(d.startswith(t + ".") and d in targets for d in DOORS):
                continue  # the (lazy) package a door lives in, imported on the way to the door
            if tier is not None and t_tier is not None and t_tier > tier:
                bad.append(f"{mod} -> {t}")
    return sorted(bad)


def test_package_has_no_import_cycle():
    graph = primerl_graph()
    for layer in LAYERS:  # the whole package is read, every layer of it
        assert any(m.startswith(f"primerl.{layer}.") for m in graph), layer
    assert "primerl.runtime.config" in graph and "primerl.kernels.gemm.dispatch" in graph
    bad = forbidden_cycles(graph)
    assert not bad, "import cycles in primerl:\n" + "\n".join(bad)


def test_config_imports_nothing_from_the_runtime():
    """``config`` is the schema and its parsing; placement, policy and launch import it, never the reverse."""
    graph = primerl_graph()
    cfg = "primerl.runtime.config"
    inside = [m for m in graph if m == cfg or m.startswith(cfg + ".")]  # a module, or a package of them
    assert inside
    up = sorted({t for m in inside for t in graph[m]
                 if t.startswith("primerl.runtime") and t != cfg and not t.startswith(cfg + ".")})
    assert not up, f"primerl.runtime.config imports {up}"


def test_no_import_goes_up_a_layer():
    bad = layer_violations(primerl_graph())
    assert not bad, "imports up a layer (kernels -> parallel -> rl -> models -> runtime):\n" + "\n".join(bad)


def test_no_import_goes_up_a_tier_in_the_runtime():
    """The process rooms (trainer, inference, orchestrator) never reach up into what starts them
    (launch) or into the job's full check (validate), and launch not into validate or cli."""
    graph = primerl_graph()
    tiers = {_runtime_tier(m) for m in graph} - {None}
    assert tiers == {0, SHARED_TIER, 2, 3, 4, 5}, tiers  # every tier has its modules
    bad = runtime_tier_violations(graph)
    assert not bad, "imports up a tier (config -> shared -> rooms -> launch -> validate -> cli):\n" + "\n".join(bad)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


@pytest.mark.parametrize("where", ["module", "function", "package_init"])
def test_the_checker_finds_a_cycle(tmp_path, where):
    """The graph reader sees a cycle made at module level, inside a function, or through a
    package ``__init__`` that re-exports; and not one hidden under ``if TYPE_CHECKING:``."""
    b_import = {"module": "from .a import x\n",
                "function": "def f():\n    from .a import x\n    return x\n",
                "package_init": "from .sub.other import v\n"}[where]
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/sub/__init__.py": "from .c import y\n",
                      "pkg/sub/c.py": "from ..b import z\ny = 1\n", "pkg/sub/other.py": "v = 0\n",
                      "pkg/a.py": "from .b import z\nx = 1\n", "pkg/b.py": b_import + "z = 2\n",
                      "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .e import w\n",
                      "pkg/e.py": "from .d import TYPE_CHECKING\nw = 0\n"})
    if where == "package_init":  # b -> pkg.sub.other, whose package's __init__ -> pkg.sub.c -> b
        (tmp_path / "pkg/a.py").write_text("x = 1\n")
    found = cycles(import_graph(tmp_path, "pkg"), "pkg")
    want = {"module": ["pkg.a", "pkg.b"], "function": ["pkg.a", "pkg.b"],
            "package_init": ["pkg.b", "pkg.sub", "pkg.sub.c"]}[where]
    assert found == [want]


def with_made_up_import(module: str, line: str) -> dict[str, set[str]]:
    """primerl's graph as if ``module`` ended with ``def _made_up(): <line>`` (an import inside a
    function, the kind the package's lazy imports are); the module's edges are read again from its
    text plus that function, by the same reader."""
    mods = module_files(ROOT)
    path, is_pkg = mods[module]
    graph = {m: set(t) for m, t in primerl_graph().items()}
    graph[module] = module_edges(module, is_pkg, path.read_text() + f"\n\ndef _made_up():\n    {line}\n", mods)
    return graph


@pytest.mark.parametrize("where", ["kernels", "across_packages", "runtime"])
def test_the_whole_package_check_finds_a_made_up_cycle(where):
    """One made-up import fails the package-wide check with exactly that cycle: between two modules
    of one package, between two subpackages of kernels, or in the runtime. (The package itself has
    none: test_package_has_no_import_cycle.)"""
    module, line, want = {
        # reference imports offsets; offsets importing reference closes the loop
        "kernels": ("primerl.kernels.gemm.offsets", "from . import reference",
                    ["primerl.kernels.gemm.offsets", "primerl.kernels.gemm.reference"]),
        # attention.ops imports kernels._backend; the reverse runs attention's __init__, which imports ops
        "across_packages": ("primerl.kernels._backend", "from .attention import ops",
                            ["primerl.kernels._backend", "primerl.kernels.attention", "primerl.kernels.attention.ops"]),
        # launch.common imports trainer.checkpoint: the reverse, the upward import this package had, made a cycle
        "runtime": ("primerl.runtime.trainer.checkpoint", "from ..launch.common import prepare_output",
                    ["primerl.runtime.launch.common", "primerl.runtime.trainer.checkpoint"]),
    }[where]
    graph = with_made_up_import(module, line)
    found = cycles(graph, "primerl")
    assert len(found) == 1 and set(want) <= set(found[0]), found
    assert forbidden_cycles(graph) == [_describe(graph, found[0])]


@pytest.mark.parametrize("module,line", [
    ("primerl.runtime.orchestrator.main", "from ..launch.common import prepare_output"),
    ("primerl.runtime.trainer.vf_warmstart", "from ..validate import load_config"),
    ("primerl.runtime.launch.common", "from ..cli import main")])
def test_the_runtime_tier_check_finds_an_upward_import(module, line):
    """The two upward imports this package had (orchestrator -> launch, trainer -> validate), and
    launch -> cli, each made up: the tier check names it."""
    bad = runtime_tier_violations(with_made_up_import(module, line))
    assert bad and all(b.startswith(f"{module} -> ") for b in bad), bad


def test_the_layer_check_finds_an_import_up_a_layer():
    bad = layer_violations(with_made_up_import("primerl.kernels.gemm.offsets", "from primerl.rl import losses"))
    # rl.losses, and the rl package's __init__ the import runs first
    assert bad == ["primerl.kernels.gemm.offsets -> primerl.rl",
                   "primerl.kernels.gemm.offsets -> primerl.rl.losses"], bad


def test_lazy_names_survive_their_submodules_imports():
    """A package that loads its names lazily (``primerl._lazy``) gives the exported object for every
    name, also after all its submodules were imported (importing a submodule binds the package's
    attribute of that name: ``primerl.models.parallelize`` is the function, not its module)."""
    code = """if True:
        import importlib, pkgutil, sys, types
        bad = []
        for pkg in ("primerl.models", "primerl.rl", "primerl.parallel", "primerl.runtime.launch"):
            m = importlib.import_module(pkg)
            for info in pkgutil.iter_modules(m.__path__):
                if not info.name.startswith("_"):
                    try:
                        importlib.import_module(f"{pkg}.{info.name}")
                    except ImportError:
                        pass  # an optional package's module (deepep, verifiers plugins)
            for name, mod in m._EXPORTS.items():
                got = getattr(m, name)
                want = getattr(sys.modules[f"{pkg}.{mod}"], name)
                if got is not want or isinstance(got, types.ModuleType):
                    bad.append(f"{pkg}.{name} is {got!r}")
        sys.exit("\\n".join(bad) if bad else 0)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
