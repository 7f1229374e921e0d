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
    return load_config(None, ["--model.n_layers", "1", "--model.dim", "32", "--model.moe_dim", "16",
                              "--max_steps", "10", *over])


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

    from torch._dynamo.backends.debugging import aot_eager
    from torch._dynamo.utils import counters

    from primerl.runtime.trainer import trainer as trainer_mod

    backend_calls = []

    def counting_aot_eager(gm, example_inputs):  # a restart of dynamo's analysis calls it again
        backend_calls.append(gm)
        return aot_eager(gm, example_inputs)

    monkeypatch.setattr(trainer_mod, "compile_model", partial(trainer_mod.compile_model, backend=counting_aot_eager))
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
    # each graph traced once: no second trace with the model's floats specialized (compile_model)
    assert len(backend_calls) == graphs[-1], f"{len(backend_calls)} backend calls for {graphs[-1]} graphs"
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


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_trainer_step_reads_the_host_once_per_optimizer_step(mini_batches):
    """The job's trainer (examples/reverse_text.toml) over 4 micro-batches: the host-side planning
    (``prepare_step``: loss counts, loss tokens, padded-attention plans, from the packed CPU batch
    before it moves to the device) is outside the count; the step's device work (``run_step``:
    forward, loss, backward of each micro-batch, clipping, fused AdamW, the guards) reads the host
    exactly once per optimizer step: the ``.tolist()`` of the step's stacked metrics, grad norm and
    guard flags in ``Trainer._optimizer_step``. Before issue 36 it read 66 times per micro-batch."""
    t = Trainer(load_config("examples/reverse_text.toml", ["--trainer.mini_batches", str(mini_batches)]), V)
    t.train_step(_payload(_job_samples(12, seed=3), 24))  # warm-up: lazy imports, optimizer state
    payload = _payload(_job_samples(12, seed=4), 24)
    assert len(payload["micro_batches"]) >= 2 * mini_batches
    prepared = t.prepare_step(payload)
    assert len(prepared) == mini_batches
    with debug_checks(False), count_host_reads(tolist=True) as reads:
        t.run_step(prepared)
    where = Counter(reads.where)
    runtime = {w: n for w, n in where.items() if "primerl/runtime" in w}
    assert len(runtime) == 1, f"runtime host reads: {runtime}"
    [(site, n)] = runtime.items()
    path, lineno = site.split(" at ", 1)[1].rsplit(":", 1)
    line = open(path).read().splitlines()[int(lineno) - 1]
    assert site.startswith("tolist at ") and path.endswith("primerl/runtime/trainer/trainer.py"), site
    assert "values = packed.tolist()" in line and n == mini_batches, (site, line, n)
    # the rest: the float32 grouped GEMM's CPU-only branches (offsets.tolist() where
    # a.device.type == "cpu"; a GPU runs torch._grouped_mm on the device offsets instead), nothing else
    others = {w: n for w, n in where.items() if w not in runtime}
    assert all(w.startswith("tolist at ") and "primerl/kernels/gemm/" in w for w in others), others
    prepared = t.prepare_step(_payload(_job_samples(12, seed=5), 24))
    with debug_checks(False), count_host_reads() as ops:  # and no dispatched read anywhere
        t.run_step(prepared)
    assert ops.total == 0, ops.where


@pytest.mark.parametrize("over", [[], ["--trainer.entropy_coef", "0.01", "--trainer.max_grad_norm", "0.5"]])
def test_trainer_step_metrics_match_per_micro_batch_host_floats(over):
    """The metrics that the step accumulates on the device and reads once equal those of the
    former per-micro-batch host arithmetic (each micro-batch's loss and metrics read as Python
    floats and combined on the host, written out here as the reference), on the same seed."""
    import math

    from primerl.runtime.trainer import _rl, next_token_logprobs

    cfg = load_config("examples/reverse_text.toml", over)
    t, ref = Trainer(cfg, V), Trainer(cfg, V)
    payload = _payload(_job_samples(12, seed=5), 24)
    assert len(payload["micro_batches"]) >= 2
    got = t.train_step(payload)

    [prep] = ref.prepare_step(payload)
    tl = cfg.trainer
    loss_sum = kl = ent_sum = cl = ch = ess = ratio_max = n_loss = 0.0
    lm = {"zero_adv_frac": 0.0, "correction_drop_frac": 0.0, "policy_kl": 0.0, "pg_loss": 0.0}
    n_pg = 0.0
    for mb, targets, _, _, _ in prep.micro_batches:
        lp, ent = next_token_logprobs(ref.model, mb, targets, replay=tl.router_replay, padded=ref.padded)
        loss, m = _rl.policy_loss(lp, mb, tl.loss, prep.counts, entropy=ent)
        total = max(int(prep.counts[0]), 1)
        if tl.entropy_coef:
            loss = loss - tl.entropy_coef * (ent * mb.loss_mask).sum() / total
        loss.backward()
        m = {key: float(v) for key, v in m.items()}
        k = int(mb.loss_mask.sum())
        loss_sum += float(loss.detach())
        kl, ent_sum = kl + m["mismatch_kl"] * k, ent_sum + m["entropy"] * k
        cl, ch, ess = cl + m["clip_frac_low"] * k, ch + m["clip_frac_high"] * k, ess + m["ess"] * k
        ratio_max = max(ratio_max, m["ratio_max"])
        for key in lm:
            lm[key] += m[key] * (1.0 if key == "pg_loss" else m["pg_tokens"] if key == "policy_kl" else k)
        n_loss, n_pg = n_loss + k, n_pg + m["pg_tokens"]
    sq = sum(float(p.grad.double().pow(2).sum()) for p in ref.model.parameters() if p.grad is not None)
    expect = {"loss": loss_sum, "mismatch_kl/mean": kl / n_loss, "entropy/mean": ent_sum / n_loss,
              "clip_frac_low": cl / n_loss, "clip_frac_high": ch / n_loss, "ess": ess / n_loss, "ratio_max": ratio_max,
              "tokens": sum(mb.num_real_tokens or mb.num_tokens for mb in payload["micro_batches"]),
              "loss_tokens": int(n_loss), "lr": tl.lr * (1 / tl.warmup_steps if tl.warmup_steps else 1.0),
              "grad_norm": math.sqrt(sq), "nan_skipped": 0,
              **{f"loss/{key}": v / (1.0 if key == "pg_loss" else n_pg if key == "policy_kl" else n_loss)
                 for key, v in lm.items()}}
    assert set(got) == set(expect), set(got) ^ set(expect)
    for key, v in expect.items():
        assert got[key] == pytest.approx(v, rel=1e-6, abs=1e-9), key
    assert 0 < prep.total == n_loss


def _job_samples(n, seed):
    """The trainer tests' samples with replay ids for the job model's 2 MoE layers."""
    out = []
    for s in _samples(n, seed=seed):
        replay = s.replay_ids.expand(-1, 2, -1).contiguous()
        out.append(replace(s, replay_ids=replay))
    return out


@pytest.mark.parametrize("attention", ["padded", "kernel"])
def test_sparse_attention_trainer_step_reads_nothing_in_the_model(attention):
    """GLM-5's sparse MLA (examples/reverse_text_glm5.toml) picks its dense or sparse form by the
    batch's longest sequence: the trainer hands it over from the host-side plan (``max_seqlen``,
    or the PaddedPlan's), so the model reads nothing on the host (it read once per forward)."""
    t = Trainer(load_config("examples/reverse_text_glm5.toml", ["--trainer.attention", attention]), V)
    assert t.model.config.is_sparse and t.padded == (attention == "padded")
    t.train_step(_payload(_job_samples(12, seed=3), 24))
    prepared = t.prepare_step(_payload(_job_samples(12, seed=4), 24))
    longest = [m[4] for p in prepared for m in p.micro_batches]
    assert all((n is None) if attention == "padded" else n > t.model.config.index_topk for n in longest), longest
    with debug_checks(False), count_host_reads(tolist=True) as reads:
        t.run_step(prepared)
    where = Counter(reads.where)
    assert not [w for w in where if "primerl/models" in w], where
    assert sum(n for w, n in where.items() if "primerl/runtime" in w) == 1, where
