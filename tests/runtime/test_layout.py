"""The runtime's layout: one room per process (trainer/, inference/, orchestrator/), every relative
import resolves, the public import paths of the README keep working, and the rooms load lazily."""

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import primerl.runtime

RUNTIME = Path(primerl.runtime.__file__).parent


def _modules():
    for path in sorted(RUNTIME.rglob("*.py")):
        rel = path.relative_to(RUNTIME.parent.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        yield path, ".".join(parts), is_pkg


def _relative_imports():
    for path, name, is_pkg in _modules():
        package = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):  # function-level (lazy) imports too
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                target = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                for alias in node.names:
                    yield f"{path.relative_to(RUNTIME)}:{node.lineno}", target, alias.name


def _source_of(module: str) -> Path | None:
    base = RUNTIME.parent.parent.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(path: Path) -> set[str]:
    """Names a module defines or imports at top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:  # `A = 1` and `A, B = 0, 1`
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def test_every_relative_import_in_the_runtime_resolves():
    """Read from the source (no import: optional dependencies such as aiohttp or vllm need not be here)."""
    bad = []
    for where, target, name in _relative_imports():
        src = _source_of(target)
        if src is None:
            bad.append(f"{where}: no module {target}")
        elif name not in _top_level_names(src) and _source_of(f"{target}.{name}") is None:
            bad.append(f"{where}: {target} has no {name}")
    assert not bad, "\n".join(bad)


ROOMS = {"trainer", "inference", "orchestrator", "launch"}


def test_rooms_hold_their_processes():
    top = {p.stem for p in RUNTIME.glob("*.py")}
    packages = {p.name for p in RUNTIME.iterdir() if (p / "__init__.py").is_file()}
    assert {"cli", "placement", "policy", "transport", "metrics", "output_dir", "lifetime", "validate"} <= top
    assert packages == ROOMS | {"config"}, "a new runtime package: a room for a process, or the config"
    assert top - {"__init__", "cli", "placement", "policy", "transport", "metrics", "output_dir", "validate",
                  "lifetime", "memory_plan", "job_checks", "zmq_transport", "registry",
                  "processes", "ports", "heartbeat", "supervise", "update_plan"} == set(), \
        "a new top-level runtime module: give it a room"
    for room, members in {"trainer": {"main", "trainer", "_rl", "checkpoint", "dcp_checkpoint", "full_state",
                                      "publish", "guards", "padded_attention"},
                          "inference": {"engine", "server", "vllm_client", "vllm_launch", "vllm_worker",
                                        "weight_sync", "hf_weights"},
                          "orchestrator": {"main", "clients", "orchestrator", "rollout", "batching", "env_calls"},
                          "launch": {"launcher", "kinds", "machine", "node", "local", "slurm", "deployment", "servers",
                                     "threads"},
                          "config": {"schema", "parse", "checks", "parallel"}}.items():
        assert members <= {p.stem for p in (RUNTIME / room).glob("*.py")}, room


def test_public_import_paths_keep_working():
    from primerl.runtime.cli import main
    from primerl.runtime.validate import load_config
    from primerl.runtime.inference import InferenceEngine, VLLMClient
    from primerl.runtime.inference import vllm_worker as new
    from primerl.runtime.inference.engine import InferenceEngine as engine_cls
    from primerl.runtime.launch.threads import run_threads
    from primerl.runtime.orchestrator import Orchestrator
    from primerl.runtime.orchestrator.orchestrator import Orchestrator as orch_cls
    from primerl.runtime.trainer import NonFiniteLossError, Trainer, lr_lambda, next_token_logprobs, shifted_logprobs
    from primerl.runtime.trainer import trainer as trainer_mod

    assert callable(main) and callable(load_config) and callable(run_threads)
    assert new.WeightUpdateExtension.__module__ == "primerl.runtime.inference.vllm_worker"
    assert (Trainer, lr_lambda, shifted_logprobs, next_token_logprobs, NonFiniteLossError) == (
        trainer_mod.Trainer, trainer_mod.lr_lambda, trainer_mod.shifted_logprobs, trainer_mod.next_token_logprobs,
        trainer_mod.NonFiniteLossError)
    assert Orchestrator is orch_cls and InferenceEngine is engine_cls and VLLMClient.__module__.endswith("vllm_client")
    with pytest.raises(ImportError, match="cannot import name 'Nope'"):
        from primerl.runtime.trainer import Nope  # noqa: F401


@pytest.mark.parametrize("gone", ["primerl.runtime.job", "primerl.runtime.vllm_worker"])
def test_compatibility_shims_are_gone(gone):
    """The old re-export modules were deleted; code imports the real modules (launch/, orchestrator/,
    trainer/, inference/vllm_worker)."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(gone)


def test_vllm_is_told_the_new_worker_extension_path():
    from primerl.runtime.validate import load_config
    from primerl.runtime.inference.vllm_client import WORKER_EXTENSION
    from primerl.runtime.inference.vllm_launch import vllm_serve_command
    from primerl.runtime.inference.vllm_worker import WeightUpdateExtension

    module, _, cls = WORKER_EXTENSION.rpartition(".")
    assert module == "primerl.runtime.inference.vllm_worker"
    assert getattr(importlib.import_module(module), cls) is WeightUpdateExtension
    cfg = load_config(None, ["--inference.vllm.model", "m"])
    cmd = vllm_serve_command(cfg.inference.vllm, cfg.model)
    assert cmd[cmd.index("--worker-extension-cls") + 1] == WORKER_EXTENSION


def test_subprocess_entry_points_are_real_modules():
    found = set()
    for path, _, _ in _modules():
        found |= set(re.findall(r'"-m",\s*"(primerl[\w.]*)"', path.read_text()))
    assert "primerl.runtime.cli" in found
    for mod in found:
        assert importlib.util.find_spec(mod) is not None, mod


@pytest.mark.parametrize("imported, not_loaded", [
    ("primerl.runtime.trainer.checkpoint", "primerl.runtime.trainer.trainer"),
    ("primerl.runtime.inference.vllm_worker", "primerl.runtime.inference.engine"),
    ("primerl.runtime.orchestrator.orchestrator", "primerl.runtime.trainer.trainer"),
    ("primerl.runtime.orchestrator.batching", "primerl.runtime.trainer"),
])
def test_rooms_load_lazily(imported, not_loaded):
    code = f"import sys, {imported}; sys.exit(1 if {not_loaded!r} in sys.modules else 0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"importing {imported} loaded {not_loaded}\n{out.stderr[-2000:]}"


def test_the_embedded_engine_samples_without_loading_dynamo():
    """An inference process (orchestrator, server) never traces: sampling through the MoE's grouped
    GEMMs must not import torch._dynamo (~2 CPU-s per process; the custom ops' first call did)."""
    code = """if True:
        import sys
        from primerl.runtime.inference.engine import InferenceEngine, Request, SamplingParams
        from primerl.runtime.policy import build_model
        from primerl.runtime.validate import load_config
        cfg = load_config("examples/reverse_text.toml", [])
        assert cfg.model.num_experts > 1
        reqs = [Request(i, [1, 2, 3], SamplingParams(max_new_tokens=4, seed=i)) for i in range(2)]
        outs = InferenceEngine(build_model(cfg, 12), max_batch_size=4).generate(reqs)
        assert [len(o.tokens) for o in outs] == [4, 4]
        sys.exit(3 if "torch._dynamo" in sys.modules else 0)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, f"sampling loaded torch._dynamo (exit {out.returncode})\n{out.stderr[-2000:]}"


def test_reading_a_layout_loads_neither_fsdp_nor_dtensor():
    """The launcher and the orchestrator validate the trainer's layout (``ParallelDims``) but never
    shard: FSDP2 and DTensor stay unloaded there (~1 CPU-s per process; ``primerl.parallel`` loads
    its names lazily)."""
    code = """if True:
        import sys
        from primerl.parallel import ParallelDims
        from primerl.runtime.validate import load_config
        cfg = load_config("examples/reverse_text.toml", ["--trainer.parallel.dp_shard", "1"])
        assert ParallelDims(dp_shard=2, world_size=2).dp_shard == 2
        loaded = [m for m in ("torch.distributed.fsdp", "torch.distributed.tensor") if m in sys.modules]
        sys.exit(f"loaded {loaded}" if loaded else 0)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]


def test_dry_run_and_plan_do_not_load_torch():
    """``primerl rl --dry-run`` and ``primerl plan`` read configs and do arithmetic: torch (~2.4 CPU-s
    per process on CI's cores) stays unloaded, as in the launcher (test_job's README-command test)."""
    code = """if True:
        import contextlib, io, sys
        from primerl.runtime.cli import main
        with contextlib.redirect_stdout(io.StringIO()) as out:
            rcs = [main(["rl", "--config", "examples/reverse_text.toml", "--dry-run"]),
                   main(["plan", "--config", "examples/reverse_text_gpu_large.toml"])]
        assert rcs == [0, 0] and "memory plan" in out.getvalue(), (rcs, out.getvalue()[-2000:])
        sys.exit(3 if "torch" in sys.modules else 0)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, f"exit {out.returncode} (3: torch was loaded)\n{out.stderr[-2000:]}"
