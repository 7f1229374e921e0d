"""``trainer.compile``: the job's trainer with its model under torch.compile(dynamic=True) matches the
eager trainer and does not recompile for a new packing; and the host reads of one full training
step of the job's model: none inside primerl.kernels, primerl.models and primerl.rl's loss, the
runtime's counted and located."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from primerl.kernels import debug_checks
from primerl.kernels.testing import count_host_reads, max_rel_err
from primerl.runtime.config import ConfigError
from primerl.runtime.validate import load_config
from primerl.runtime.trainer import Trainer

from test_trainer import _payload, _samples, V  # the trainer tests' samples and packing

# torch.compile cannot trace the tests' NaN-poisoning wrapper of torch.empty (a Python function
# around the C builtin), and the meta device context does not reach through it: compiled results are
# compared with eager instead.
pytestmark = pytest.mark.no_poison


def _cfg(*over):
    return load_config(None, ["--model.n_layers", "1", "--model.dim", "32", "--model.moe_dim", "16", "--max_steps", "10",
                              *over])


def test_compile_key_is_off_by_default_and_validated():
    assert _cfg().trainer.compile is False
    assert _cfg("--trainer.compile", "true").trainer.compile is True
    with pytest.raises(ConfigError, match="trainer.compile"):
        _cfg("--trainer.compile", "sometimes")


def test_compiled_trainer_matches_eager_without_recompiling(monkeypatch):
    """The trainer's compile wiring with the aot_eager backend (inductor's C++ compile of the whole
    trainer graph takes minutes on a loaded 2-core CI box; the model's inductor forward and backward
    are checked in tests/models/test_compile_model.py)."""
    from functools import partial

    from torch._dynamo.utils import counters

    from primerl.runtime.trainer import trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "compile_model", partial(trainer_mod.compile_model, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = Trainer(_cfg(), V), Trainer(_cfg("--trainer.compile", "true"), V)
    graphs = []
    for i, (n, seq_len) in enumerate([(6, 64), (9, 64), (5, 20)]):  # other token and sequence counts
        me = eager.train_step(_payload(_samples(n, seed=i), seq_len))
        mc = compiled.train_step(_payload(_samples(n, seed=i), seq_len))
        assert mc["loss"] == pytest.approx(me["loss"], rel=1e-4, abs=1e-6), f"step {i}"
        graphs.append(counters["stats"]["unique_graphs"])
    for (name, p), q in zip(eager.model.named_parameters(), compiled.model.parameters()):
        assert max_rel_err(q.detach(), p.detach()) < 1e-4, name
    # at most 2 graphs: one for micro-batches of >= 2 sequences and, once, one for a micro-batch of a
    # single sequence (dynamo specialises sizes 0 and 1; the (5, 20) packing has one)
    assert graphs[-1] <= 2, f"graphs after each step {graphs}: a new packing recompiled"
    torch._dynamo.reset()


def _job_step_parts(seed=0, lens=(10,) * 12):
    """examples/reverse_text.toml's model and loss, a packed batch and a fused AdamW."""
    from primerl.kernels.logprobs import fused_logprobs
    from primerl.rl import policy_loss
    from primerl.runtime.policy import build_model

    cfg = load_config("examples/reverse_text.toml", [])
    model = build_model(cfg, V)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])
    ids = torch.randint(0, V, (T,), generator=g)
    old, adv, mask = -torch.rand(T, generator=g), torch.randn(T, generator=g), torch.rand(T, generator=g) > 0.3
    hp = cfg.trainer.loss.hparams

    def step():
        hidden = model(ids, pos, cu)
        lp, _ = fused_logprobs(hidden, model.lm_head.weight, torch.roll(ids, -1))
        loss, _ = policy_loss(lp, old, adv, mask, method=cfg.trainer.loss.method, cu_seqlens=cu, **hp)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def test_training_step_has_no_host_read_in_kernels_model_or_loss():
    """forward, fused_logprobs, policy_loss with cu_seqlens, backward and a (fused) AdamW step."""
    step = _job_step_parts()
    step()  # warm-up: lazy imports, optimizer state
    with debug_checks(False), count_host_reads() as reads:
        step()
    assert reads.total == 0, f"host reads: {reads.counts} at {Counter(reads.where)}"


def _bucket(where: str) -> str:
    for part in ("primerl/kernels", "primerl/models", "primerl/rl", "primerl/runtime", "primerl/parallel"):
        if part in where:
            return part
    return "other"


def test_trainer_step_host_reads_are_the_runtimes_only():
    """The job's trainer's own step (Trainer.train_step): every host read is in primerl/runtime
    (metrics, the packer's plan, the optimizer's step counter), none below it."""
    t = Trainer(load_config("examples/reverse_text.toml", []), V)
    t.train_step(_payload(_job_samples(8, seed=3), 64))
    payload = _payload(_job_samples(8, seed=4), 64)
    with debug_checks(False), count_host_reads() as reads:
        t.train_step(payload)
    where = Counter(reads.where)
    by_bucket = Counter(_bucket(w) for w in reads.where)
    assert set(by_bucket) <= {"primerl/runtime"}, f"host reads below the runtime: {where}"
    # one micro-batch of 8 samples (bench/RESULTS.md, issue 36, has the table): 25 AdamW step counters (CPU
    # tensors, foreach AdamW), 10 loss counts on the packed batch before it moves to the device, 3 the
    # padded plan, 21 metrics to Python floats (loss, policy_loss's 13 metrics, LossMetrics' 6, ...),
    # grad norm 1, finite checks 2, ... 66 in all
    assert reads.total == 66, f"runtime host reads per step: {reads.total} {dict(where)}"


def _job_samples(n, seed):
    """The trainer tests' samples with replay ids for the job model's 2 MoE layers."""
    out = []
    for s in _samples(n, seed=seed):
        replay = s.replay_ids.expand(-1, 2, -1).contiguous()
        out.append(replace(s, replay_ids=replay))
    return out
