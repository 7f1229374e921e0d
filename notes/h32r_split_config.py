"""Split primerl/runtime/config.py into the package primerl/runtime/config/ by section (a pure move).

    python notes/h32r_split_config.py [REPO]      # then: git add -A primerl/runtime/config*

Every top-level definition goes, with the comments above it, to one of:
  schema.py    ConfigError, _need, the section dataclasses, trainer_ranks_per_node
  parse.py     TOML + ``--key.sub value`` overrides: from_dict, apply_override, load_config, to_toml
  checks.py    validate (validate_fields, validate_names, validate_finite, the [inference.pd] checks)
  parallel.py  trainer.parallel: parallel_dims, cp_degrees, validate_parallel, describe_parallel
A definition this script does not know (a helper added after it was written) goes to the module of
the definition just above it. ``__init__.py`` keeps the module docstring and re-exports every public
name, so ``from primerl.runtime.config import X`` keeps working. Written to be re-run after other
branches that edit config.py are merged (it reads whatever config.py holds).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SECTIONS = {
    "schema": ["ConfigError", "_need", "ModelConfig", "EnvConfig", "VLLMConfig", "PDConfig", "InferenceConfig",
               "OrchestratorConfig", "LossConfig", "ParallelConfig", "TrainerConfig", "CheckpointConfig",
               "WarmStartConfig", "LogConfig", "DeploymentConfig", "RLConfig", "trainer_ranks_per_node"],
    "parse": ["_hints", "_coerce", "from_dict", "to_dict", "apply_override", "_parse_scalar", "parse_overrides",
              "load_config", "_drop_replaced_method_hparams", "_toml_value", "to_toml"],
    "checks": ["_validate_pd", "validate", "validate_fields", "validate_finite", "validate_names"],
    "parallel": ["FP8_RECIPES", "_FP8_BLOCK", "parallel_dims", "_model_dims", "_sequence_level_loss", "CP_KINDS",
                 "cp_degrees", "_attention_heads", "validate_cp_split", "validate_parallel", "describe_parallel",
                 "describe_cp"],
}
DOCS = {
    "schema": "The job config's sections as dataclasses, ``ConfigError`` and the ``_need`` check helper.",
    "parse": "TOML + ``--key.sub value`` overrides to an ``RLConfig`` (``load_config``), and back (``to_toml``).",
    "checks": "``validate``: range and choice checks of every section, names (loss, environment,\n"
              "model.path), finite numbers; the trainer layout is ``parallel.validate_parallel``.",
    "parallel": "``trainer.parallel`` against ``num_trainer_ranks``, the model and the loss; the mesh as\n"
                "``--dry-run`` prints it.",
}
ORDER = ["schema", "parallel", "checks", "parse"]  # each imports only those before it


def _name(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
        return node.name
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def _import_line(mod: str, names: list[str], tail: str = "") -> str:
    """``from .mod import a, b`` wrapped in parentheses at 120 columns."""
    one = f"from .{mod} import {', '.join(names)}{tail}\n"
    if len(one) <= 121:
        return one
    out, line = f"from .{mod} import (", ""
    rows = []
    for n in names:
        piece = f"{n}, "
        if len(line) + len(piece) > 110:
            rows.append(line.rstrip())
            line = ""
        line += piece
    rows.append(line.rstrip().rstrip(","))
    return out + tail + "\n" + "".join(f"    {r}\n" for r in rows) + ")\n"


def _used(text: str) -> set[str]:
    tree = ast.parse(text)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def split(repo: Path) -> None:
    src_path = repo / "primerl/runtime/config.py"
    src = src_path.read_text()
    lines = src.splitlines(keepends=True)
    tree = ast.parse(src)
    where = {n: mod for mod, names in SECTIONS.items() for n in names}
    doc = ast.get_docstring(tree, clean=False)
    header_imports: list[tuple[ast.stmt, str]] = []  # (node, its source)
    chunks: dict[str, list[str]] = {m: [] for m in SECTIONS}
    defined: dict[str, str] = {}
    prev_end, current = 0, "schema"
    for node in tree.body:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        if isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant) and node.lineno == 1:
            prev_end = node.end_lineno
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                header_imports.append((node, "".join(lines[node.lineno - 1:node.end_lineno])))
            prev_end = node.end_lineno
            continue
        name = _name(node)
        current = where.get(name, current)
        if name:
            defined[name] = current
        text = "".join(lines[prev_end:node.end_lineno])  # the comments above it travel with it
        chunks[current].append(text)
        prev_end = node.end_lineno
    out = repo / "primerl/runtime/config"
    out.mkdir()
    for mod in ORDER:
        body = "".join(chunks[mod]).strip("\n") + "\n"
        used = _used(body)
        imports = [text for node, text in header_imports
                   if any((a.asname or a.name).split(".")[0] in used for a in node.names)]
        siblings = []
        for other in sorted(ORDER):
            names = sorted(n for n, m in defined.items() if m == other and other != mod and n in used)
            if names:
                assert ORDER.index(other) < ORDER.index(mod), f"{mod} would import {other}: {names}"
                siblings.append(_import_line(other, names))
        std = [t for t in imports if not t.startswith("from dataclasses") and not t.startswith("from pathlib")
               and not t.startswith("from typing")]
        frm = [t for t in imports if t not in std]
        blocks = [f'"""{DOCS[mod]}"""\n', "from __future__ import annotations\n"]
        blocks += [b for b in ("".join(std) + "".join(frm), "".join(siblings)) if b]
        (out / f"{mod}.py").write_text("\n".join(blocks) + "\n\n" + body)
    public = {m: sorted(n for n, mm in defined.items() if mm == m and not n.startswith("_")) for m in ORDER}
    doc = doc.strip("\n").replace("This module imports nothing", "This package imports nothing")
    init = f'"""{doc}\n\nModules: schema (the sections), parse (TOML, overrides, to_toml), checks (validate),\nparallel (trainer.parallel). Every public name is re-exported here.\n"""\n\nfrom __future__ import annotations\n\n'
    for m in sorted(ORDER):
        init += _import_line(m, public[m], "  # noqa: F401")
    allnames = sorted(n for m in ORDER for n in public[m])
    rows, line = [], ""
    for n in allnames:
        if len(line) + len(n) + 4 > 110:
            rows.append(line.rstrip())
            line = ""
        line += f'"{n}", '
    rows.append(line.rstrip().rstrip(","))
    init += "\n__all__ = [\n" + "".join(f"    {r}\n" for r in rows) + "]\n"
    (out / "__init__.py").write_text(init)
    src_path.unlink()


if __name__ == "__main__":
    split(Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve())
