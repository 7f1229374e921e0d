"""The device-dependent parts of the job, exercised on the CPU: the embedded engine's weight
broadcast (gloo here, NCCL between GPUs: the same code), the bf16 mixed-precision trainer
(FSDP2's policy on a one-rank mesh), and the engine's KV-cache budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from primerl.runtime.validate import load_config
from primerl.runtime.inference.engine import EngineError, InferenceEngine, Request, SamplingParams
from primerl.runtime.launch.threads import run_threads
from primerl.runtime.policy import build_model
from primerl.runtime.trainer import Trainer
from primerl.runtime.inference.weight_sync import EngineWeightReceiver, WeightSyncError

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--max_steps", "4", "--orchestrator.batch_size", "4", "--orchestrator.group_size", "4",
         "--orchestrator.max_async_level", "0", "--checkpoint.interval", "0", "--log.plot", "false",
         "--log.progress", "false", "--orchestrator.weights_timeout_s", "60", "--trainer.batch_timeout_s", "60"]


def _port() -> int:
    """A free port, reserved until this process exits (no other process can take it first)."""
    from primerl.runtime.ports import held_port

    return held_port()


def _cfg(out, *over):
    return load_config(ROOT / "examples" / "reverse_text.toml", ["--output_dir", str(out), *SMALL, *over])


def test_broadcast_to_the_embedded_engine_trains_exactly_as_files(tmp_path):
    """gloo broadcast from the trainer to the engine's receiver thread: the same run as through the
    filesystem (synchronous level, so the versions sampled are the same), with marker-only versions."""
    files = run_threads(_cfg(tmp_path / "files"))
    parts = {}
    bcast = run_threads(_cfg(tmp_path / "bcast", "--inference.weight_update", "broadcast",
                             "--inference.broadcast_port", str(_port())), parts=parts)
    assert [r["step"] for r in bcast] == list(range(4))
    for a, b in zip(files, bcast):
        assert (a["reward/mean"], a["loss"], a["policy_version"]) == (b["reward/mean"], b["loss"], b["policy_version"])
    assert parts["client"].receiver is not None
    versions = sorted((tmp_path / "bcast" / "transport" / "weights").glob("step_*"))
    assert versions and all((d / "STABLE").exists() and not (d / "model.safetensors").exists() for d in versions)
    assert not parts["client"].receiver._thread.is_alive(), "the goodbye message must end the receiver"


def test_receiver_that_never_joins_reports_why():
    rx = EngineWeightReceiver("127.0.0.1", _port(), backend="gloo", device=torch.device("cpu"), timeout_s=1.0).start()
    with pytest.raises(WeightSyncError, match="weights version 0 by broadcast from the trainer: the receiver failed"):
        rx.take(0, timeout=20)


def test_new_group_refuses_an_unknown_backend():
    from primerl.runtime.inference.weight_broadcast import new_group

    with pytest.raises(ValueError, match="backend must be 'nccl', 'gloo' or None"):
        new_group("127.0.0.1", _port(), 0, 1, backend="mpi")


def _payload(vocab: int, seed: int = 0):
    from primerl.rl.packing import Sample, pack

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(6):
        P, C = 6, 4 + i % 3
        mask = torch.tensor([False] * P + [True] * C)
        samples.append(Sample(torch.randint(0, vocab, (P + C,), generator=g), mask, 0.5 + i % 2,
                              torch.where(mask, -torch.rand(P + C, generator=g), torch.zeros(P + C)), 1.0,
                              torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(2 * (P + C))])
                              .view(P + C, 2, 2)))
    return {"micro_batches": pack(samples, 256, 1, pad_to_seq_len=False)[0], "metrics": {}}


def test_mixed_precision_trainer_keeps_float32_masters_and_computes_in_bf16(tmp_path):
    from torch.distributed.fsdp import FSDPModule

    over = ["--trainer.lr_schedule", "constant"]
    ref = Trainer(_cfg(tmp_path, *over), 12)
    mixed = Trainer(_cfg(tmp_path, *over, "--trainer.mixed_precision", "bf16"), 12)
    try:
        assert not isinstance(ref.model, FSDPModule) and not ref.mixed_precision
        assert isinstance(mixed.model, FSDPModule) and mixed.fsdp and mixed.mesh.size() == 1
        policy = mixed.model._get_fsdp_state()._mp_policy
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
        assert {p.to_local().dtype for p in mixed.model.parameters()} == {torch.float32}
        seen = []
        hook = mixed.model.layers[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        rows = [(ref.train_step(_payload(12, s)), mixed.train_step(_payload(12, s))) for s in range(2)]
        hook.remove()
        assert seen and set(seen) == {torch.bfloat16}, "the blocks must compute in bf16"
        for a, b in rows:  # the same objective, bf16 rounding apart
            assert b["loss"] == pytest.approx(a["loss"], rel=3e-2)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)
        states = [mixed.optimizer.state[p] for p in mixed.model.parameters()]
        assert {s["exp_avg"].to_local().dtype for s in states} == {torch.float32}
        full = mixed.state_dict_for_publish()  # plain full tensors, float32, for the engine / files
        assert {t.dtype for t in full.values() if t.is_floating_point()} == {torch.float32}
        assert not any(hasattr(t, "to_local") for t in full.values())
    finally:
        mixed.close()
    assert not torch.distributed.is_initialized(), "the one-rank group is the trainer's to close"


def test_kv_cache_budget_is_enforced_by_name():
    cfg = load_config(ROOT / "examples" / "reverse_text.toml", [])
    model = build_model(cfg, 12)
    per_position = 2 * cfg.model.n_layers * cfg.model.n_kv_heads * cfg.model.head_dim * 4  # K and V, float32
    need_gb = 8 * 64 * per_position / 2**30  # 8 slots x the first capacity (64 positions)
    reqs = [Request(i, [1, 2, 3], SamplingParams(max_new_tokens=4, seed=i)) for i in range(3)]
    with pytest.raises(EngineError, match="over inference.kv_cache_gb"):
        InferenceEngine(model, max_batch_size=8, kv_cache_gb=need_gb * 0.9).generate(reqs)
    outs = InferenceEngine(build_model(cfg, 12), max_batch_size=8, kv_cache_gb=need_gb * 1.01).generate(reqs)
    assert [len(o.tokens) for o in outs] == [4, 4, 4]
    with pytest.raises(ValueError, match="kv_cache_gb must be >= 0"):
        InferenceEngine(model, kv_cache_gb=-1.0)
