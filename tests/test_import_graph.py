"""The package's import graph, read with ``ast`` (module-level and function-level imports alike):
no import cycle among ``primerl.runtime``'s modules, and no import up a layer
(kernels -> parallel -> rl -> models -> runtime)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "parallel", "rl", "models", "runtime")

# Cycles that are genuinely required, each with its reason: (sorted module names) -> reason. Empty.
ALLOWED_RUNTIME_CYCLES: dict[tuple[str, ...], str] = {}


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


def import_graph(root: Path, package: str = "primerl") -> dict[str, set[str]]:
    """Edges module -> module it imports (anywhere in its body; ``if TYPE_CHECKING:`` blocks are
    skipped, they never run). Importing ``a.b.c`` from outside ``a.b`` also runs ``a.b``'s
    ``__init__``, so that edge is added too."""
    mods = module_files(root, package)
    graph: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
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
        graph[mod] = {t for t in edges if t in mods}
    return graph


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


def test_runtime_has_no_import_cycle():
    graph = primerl_graph()
    assert "primerl.runtime.config" in graph and "primerl.runtime.validate" in graph
    bad = [c for c in cycles(graph, "primerl.runtime") if tuple(c) not in ALLOWED_RUNTIME_CYCLES]
    assert not bad, "import cycles in primerl.runtime:\n" + "\n".join(_describe(graph, c) for c in bad)


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
    graph = primerl_graph()
    bad = []
    for mod, targets in graph.items():
        layer = mod.split(".")[1] if mod.count(".") else None
        for t in targets:
            t_layer = t.split(".")[1] if t.count(".") else None
            if layer in LAYERS and t_layer in LAYERS and LAYERS.index(t_layer) > LAYERS.index(layer):
                bad.append(f"{mod} -> {t}")
    assert not bad, "imports up a layer (kernels -> parallel -> rl -> models -> runtime):\n" + "\n".join(sorted(bad))


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
