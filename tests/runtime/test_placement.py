"""Device resolution and placement (``primerl.runtime.placement``), checked on the CPU for any
GPU count: who runs where, which backend, which precision, and the named config errors."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from primerl.runtime import cli
from primerl.runtime.config import ConfigError
from primerl.runtime.validate import load_config
from primerl.runtime.placement import describe_placement, resolve_placement

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*over, example="reverse_text.toml"):
    return load_config(ROOT / "examples" / example, list(over), check=False)


@pytest.mark.parametrize("gpus, ranks, gpu_ids, expect", [
    (0, 1, [], ("cpu", (), None, "filesystem")),
    (0, 4, [], ("cpu", (), None, "filesystem")),
    (1, 1, [], ("cuda", (0,), 0, "filesystem")),  # shared GPU: no NCCL between two ranks on one device
    (1, 1, [0], ("cuda", (0,), 0, "filesystem")),
    (2, 1, [], ("cuda", (1,), 0, "broadcast")),
    (8, 4, [], ("cuda", (1, 2, 3, 4), 0, "broadcast")),
    (4, 2, [3], ("cuda", (0, 1), 3, "broadcast")),
])
def test_placement_by_gpu_count(gpus, ranks, gpu_ids, expect):
    p = resolve_placement(_cfg("--num_trainer_ranks", str(ranks), "--inference.gpu_ids", str(gpu_ids)), gpus)
    assert (p.device, p.trainer_gpus, p.engine_gpu, p.weight_update) == expect
    assert p.shared == (gpus == 1)
    assert p.dist_backend == ("gloo" if gpus == 0 else "cuda:nccl,cpu:gloo")
    assert p.broadcast_backend == ("gloo" if gpus == 0 else "nccl")
    if gpus:
        assert [p.trainer_device(r) for r in range(ranks)] == [torch.device("cuda", g) for g in expect[1]]
        assert p.engine_device() == torch.device("cuda", expect[2])
    else:
        assert p.trainer_device(0) == p.engine_device() == torch.device("cpu")


def test_vllm_backend_leaves_the_listed_gpus_to_the_server():
    p = resolve_placement(_cfg("--inference.backend", "vllm", "--num_trainer_ranks", "2",
                               "--inference.gpu_ids", "[0, 1]"), 4)
    assert (p.trainer_gpus, p.engine_gpu, p.weight_update) == ((2, 3), None, "vllm")
    p = resolve_placement(_cfg("--inference.backend", "vllm", "--num_trainer_ranks", "2"), 2)
    assert p.trainer_gpus == (0, 1)


@pytest.mark.parametrize("over, gpus, key, words", [
    (["--device", "cuda"], 0, "device", "sees no CUDA device"),
    (["--device", "tpu"], 1, "device", "must be auto, cpu or cuda"),
    (["--num_trainer_ranks", "2"], 1, "num_trainer_ranks", "this machine has 1"),
    (["--num_trainer_ranks", "4"], 4, "num_trainer_ranks", "3 of the 4 visible are left"),
    (["--inference.gpu_ids", "[2]"], 2, "inference.gpu_ids", "do not exist"),
    (["--inference.gpu_ids", "[0]", "--device", "cpu"], 2, "inference.gpu_ids", "runs on the CPU"),
    (["--inference.gpu_ids", "[0, 1]"], 4, "inference.gpu_ids", "embedded engine runs on one GPU"),
    (["--inference.weight_update", "broadcast"], 1, "inference.weight_update", "GPU of its own"),
    (["--trainer.mixed_precision", "bf16", "--num_trainer_ranks", "2", "--trainer.fsdp", "false"], 4,
     "trainer.mixed_precision", "trainer.fsdp = true"),
])
def test_placement_errors_name_the_key(over, gpus, key, words):
    with pytest.raises(ConfigError) as e:
        resolve_placement(_cfg(*over), gpus)
    assert str(e.value).startswith(f"{key}:") and words in str(e.value), str(e.value)


@pytest.mark.parametrize("over, key", [
    (["--trainer.mixed_precision", "fp16"], "trainer.mixed_precision"),
    (["--trainer.mixed_precision", "bf16", "--model.dtype", "bfloat16"], "trainer.mixed_precision"),
    (["--inference.kv_cache_gb", "-1"], "inference.kv_cache_gb"),
    (["--inference.weight_update", "nccl"], "inference.weight_update"),
    (["--inference.gpu_ids", "[0, 0]"], "inference.gpu_ids"),
    (["--device", "cuda"], "device"),  # this machine has no GPU: validate() runs the placement
])
def test_validate_rejects_before_anything_starts(over, key):
    if key == "device" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=f"^{key}:"):
        load_config(ROOT / "examples" / "reverse_text.toml", over)


@pytest.mark.parametrize("over, gpus, mixed, dtype", [
    ([], 0, False, torch.float32),  # auto: off on the CPU
    ([], 1, True, torch.bfloat16),  # auto: bf16 on CUDA
    (["--model.dtype", "bfloat16"], 1, False, torch.bfloat16),  # pure bf16 stays pure bf16
    (["--trainer.mixed_precision", "off"], 1, False, torch.float32),
    (["--trainer.mixed_precision", "bf16"], 0, True, torch.bfloat16),  # also on the CPU (how it is tested here)
    (["--num_trainer_ranks", "2", "--trainer.fsdp", "false"], 4, False, torch.float32),  # auto: no FSDP, no policy
])
def test_mixed_precision_choice(over, gpus, mixed, dtype):
    p = resolve_placement(_cfg(*over), gpus)
    assert (p.mixed_precision, p.param_dtype) == (mixed, dtype)


def test_dry_run_prints_the_placement():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["rl", "--config", str(ROOT / "examples" / "reverse_text.toml"), "--dry-run"]) == 0
    out = buf.getvalue()
    assert "# placement: device = cpu" in out
    assert "# trainer: 1 rank(s) on the CPU, gloo; float32 throughout" in out
    assert "# inference: embedded engine on the CPU" in out


def test_describe_placement_on_gpus():
    text = describe_placement(_cfg(example="reverse_text_gpu.toml"), 2)
    assert "rank 0 -> cuda:1" in text and "embedded engine on cuda:0" in text
    assert "nccl broadcast from trainer rank 0" in text and "bf16 compute, float32 master weights" in text
    text = describe_placement(_cfg(example="reverse_text_gpu.toml"), 1)
    assert "embedded engine on cuda:0 (shared with the trainer" in text and "KV cache <= 4 GB" in text


def test_gpu_example_without_a_gpu_is_a_config_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main(["rl", "--config", str(ROOT / "examples" / "reverse_text_gpu.toml"), "--dry-run"]) == 2
    assert "config error: device: 'cuda' but torch sees no CUDA device" in capsys.readouterr().err


def test_large_gpu_example_is_about_100m_parameters_and_places_on_one_gpu():
    from primerl.models import MoETransformer
    from primerl.rl.envs import load_environment
    from primerl.runtime.policy import model_config

    cfg = _cfg(example="reverse_text_gpu_large.toml")
    env = load_environment(cfg.env.id, **cfg.env.args)
    with torch.device("meta"):
        model = MoETransformer(model_config(cfg, env.vocab_size))
    n = sum(p.numel() for p in model.parameters())
    assert 90e6 < n < 130e6, n
    p = resolve_placement(cfg, 1)
    assert (p.trainer_gpus, p.engine_gpu, p.mixed_precision) == ((0,), 0, True)
    load_config(ROOT / "examples" / "reverse_text_gpu_large.toml", ["--device", "cpu"])  # every other check passes


def test_a_cpu_build_of_torch_sees_no_gpu_without_loading_torch(tmp_path, monkeypatch):
    """The launcher asks how many GPUs torch can use; a CPU build of torch (its ``version.py``
    says cuda = hip = None) can use none, and that is read without importing torch."""
    import importlib.machinery
    import importlib.util

    from primerl.runtime import placement

    def fake_torch(text):
        pkg = tmp_path / str(len(list(tmp_path.iterdir()))) / "torch"
        pkg.mkdir(parents=True)
        (pkg / "version.py").write_text(text)
        spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
        spec.submodule_search_locations = [str(pkg)]
        return spec

    modules = {k: v for k, v in sys.modules.items() if k != "torch"}
    monkeypatch.setattr(sys, "modules", modules)  # as in a launcher that has not loaded torch
    cpu = "from typing import Optional\ncuda: Optional[str] = None\nhip: Optional[str] = None\n"
    for text, has_gpu in ((cpu, False), (cpu.replace("cuda: Optional[str] = None", "cuda = '12.8'"), True),
                          (cpu.replace("hip: Optional[str] = None", "hip: Optional[str] = '6.4'"), True),
                          ("__version__ = '9'\n", True)):  # no build lines: unsure, torch is asked
        spec = fake_torch(text)
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, _s=spec: _s if name == "torch" else None)
        assert placement._torch_build_has_gpu() is has_gpu, text
    monkeypatch.undo()
    code = ("import sys; from primerl.runtime.placement import visible_gpus; n = visible_gpus(); "
            "sys.exit(f'{n} GPUs, torch loaded' if n or 'torch' in sys.modules else 0)")
    if torch.version.cuda is None and torch.version.hip is None:  # this machine's CPU build
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
