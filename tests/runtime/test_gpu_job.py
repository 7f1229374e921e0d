"""The job on GPUs (``gpu``-marked: skipped without CUDA; run by bench/gpu_check.sh).

- one GPU: trainer and embedded engine share it for 24 steps of the GPU example; parameters,
  the KV cache and the engine's logits live on CUDA, the trainer computes in bf16 over float32
  master weights, and the reward rises.
- one GPU through the launcher (``run_rl``: two processes sharing it).
- two GPUs: the engine on GPU 0, the trainer on GPU 1, weights by NCCL broadcast (the
  processes' logs say where each side ran), at async levels 0 and 1.
- two NCCL trainer ranks against one process (the gold test of test_trainer_parallel, on GPUs).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest
import torch

from primerl.runtime.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.gpu


def _gpu_cfg(out, *over):
    return load_config(ROOT / "examples" / "reverse_text_gpu.toml", [
        "--output_dir", str(out), "--checkpoint.interval", "0", "--log.plot", "false", "--log.progress", "false",
        *over])


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_one_gpu_job_trains_on_the_gpu(tmp_path):
    from primerl.runtime.launch.threads import run_threads

    # constant lr, no entropy bonus: the reward rises by ~0.2 within 24 steps (first 4 -> last 4
    # steps: 0.11 -> 0.33 / 0.30 for seeds 0 / 1, the example's config run with --device cpu)
    cfg = _gpu_cfg(tmp_path / "job", "--max_steps", "24", "--inference.gpu_ids", "[0]",
                   "--trainer.lr_schedule", "constant", "--trainer.entropy_coef", "0")
    seen = {}
    parts = {}

    def spy_client(parts):  # wraps the engine's forward once the client exists
        engine = parts["client"].engine
        inner = engine._forward_cached

        def forward(active):
            logits, routing = inner(active)
            seen.setdefault("logits", logits.device)
            seen.setdefault("kv", engine._k.device)
            return logits, routing

        engine._forward_cached = forward

    class Parts(dict):
        def __setitem__(self, k, v):
            super().__setitem__(k, v)
            if k == "client":
                spy_client(self)

    parts = Parts()
    rows = run_threads(cfg, parts=parts)
    assert [r["step"] for r in rows] == list(range(24))
    engine, trainer = parts["client"].engine, parts["trainer"]
    assert seen["logits"].type == "cuda" and seen["kv"].type == "cuda", seen
    assert {p.device.type for p in engine.model.parameters()} == {"cuda"}
    assert engine.model.embed.weight.dtype == torch.bfloat16
    local = [p.to_local() if hasattr(p, "to_local") else p for p in trainer.model.parameters()]
    assert {p.device.type for p in local} == {"cuda"}
    assert {p.dtype for p in local} == {torch.float32}, "master weights must stay float32"
    assert trainer.mixed_precision and trainer.placement.param_dtype == torch.bfloat16
    state = trainer.optimizer.state[next(iter(trainer.model.parameters()))]
    assert state["exp_avg"].dtype == torch.float32
    first = statistics.mean(r["reward/mean"] for r in rows[:4])
    last = statistics.mean(r["reward/mean"] for r in rows[-4:])
    assert last > first + 0.1, [round(r["reward/mean"], 3) for r in rows]
    assert rows[-1]["memory/trainer_peak_gb"] > 0 and rows[-1]["memory/engine_peak_gb"] > 0


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_one_gpu_job_through_the_launcher(tmp_path):
    """The same layout as ``primerl rl`` runs it: two processes sharing the GPU (files)."""
    from primerl.runtime.launch.machine import run_rl

    cfg = _gpu_cfg(tmp_path / "job", "--max_steps", "4", "--inference.gpu_ids", "[0]")
    rows = run_rl(cfg, quiet=True)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    logs = Path(cfg.output_dir) / "logs"
    assert "embedded engine on cuda:0" in (logs / "orchestrator.log").read_text()
    assert rows[-1]["memory/trainer_peak_gb"] > 0 and rows[-1]["memory/engine_peak_gb"] > 0


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs (engine on one, trainer on another); {GPUS} visible")
def test_two_gpu_layout_puts_the_engine_on_its_own_gpu(tmp_path):
    from primerl.runtime.launch.machine import run_rl
    from primerl.runtime.placement import resolve_placement

    cfg = _gpu_cfg(tmp_path / "job", "--max_steps", "6", "--orchestrator.max_async_level", "0")
    p = resolve_placement(cfg)
    assert (p.engine_gpu, p.trainer_gpus, p.weight_update) == (0, (1,), "broadcast")
    rows = run_rl(cfg, quiet=True)
    assert len(rows) == 6
    logs = Path(cfg.output_dir) / "logs"
    assert "embedded engine on cuda:0" in (logs / "orchestrator.log").read_text()
    assert "on cuda:1" in (logs / "trainer.log").read_text()
    # async level 1: the orchestrator's last batch comes before the trainer's last versions (NCCL)
    rows = run_rl(_gpu_cfg(tmp_path / "async1", "--max_steps", "6", "--orchestrator.max_async_level", "1"), quiet=True)
    assert len(rows) == 6
    log = (tmp_path / "async1" / "logs" / "orchestrator.log").read_text()
    assert "the trainer ended its updates after version 6" in log


def _nccl_worker(rank, world, tmp, ref):
    import datetime

    import torch.distributed as dist

    from test_trainer_parallel import _compare, _train  # noqa: F401 (the gold test's data and checks)

    os.environ["LOCAL_RANK"] = str(rank)
    torch.cuda.set_device(rank)
    dist.init_process_group("cuda:nccl,cpu:gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        from primerl.runtime.trainer import Trainer

        trainer = Trainer(_nccl_cfg(world), 12, rank=rank, world_size=world)
        rows, weights = _train(trainer, trainer.dims.batch)
        errors = _compare(rows, {k: v.cpu() for k, v in weights.items()}, ref, check_weights=rank == 0)
        Path(tmp, f"rank{rank}.txt").write_text("\n".join(errors))
    finally:
        dist.destroy_process_group()


def _nccl_cfg(ranks):
    from test_trainer_parallel import MODEL

    # inference.backend = vllm: no embedded engine claims a GPU, the trainer ranks take GPUs 0..n-1
    return load_config(None, [*MODEL, "--num_trainer_ranks", str(ranks), "--trainer.lr", "1e-4", "--device", "cuda",
                              "--trainer.mixed_precision", "off", "--inference.backend", "vllm"])


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs for 2 NCCL trainer ranks; {GPUS} visible")
def test_two_nccl_trainer_ranks_match_one_process(tmp_path):
    import sys

    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).parent))
    from test_trainer_parallel import _train
    from primerl.runtime.trainer import Trainer

    rows, weights = _train(Trainer(_nccl_cfg(1), 12), 1)
    ref = (rows, {k: v.cpu() for k, v in weights.items()})
    mp.spawn(_nccl_worker, args=(2, str(tmp_path), ref), nprocs=2, join=True)
    errors = [Path(tmp_path, f"rank{r}.txt").read_text() for r in range(2)]
    assert errors == ["", ""], errors
