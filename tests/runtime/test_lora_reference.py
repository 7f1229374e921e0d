"""The KL reference of a LoRA job (``trainer.loss.ref_kl_coef > 0`` with ``[trainer.lora]``) is the
policy with its adapters disabled, the frozen base, not a second copy of the model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from test_loss_config import _ranked_payload
from test_trainer import V, _cfg, _payload, _samples

from primerl.runtime.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_dist import spawn  # noqa: E402

LORA = ("--trainer.lora.rank", "4", "--trainer.lora.alpha", "8", "--trainer.lora.targets", "attention,experts",
        "--trainer.loss.ref_kl_coef", "1.0", "--trainer.router_replay", "false")


def _logprobs(model):
    ids = torch.tensor([1, 5, 2, 7, 3, 9, 4])
    pos, cu = torch.arange(7), torch.tensor([0, 7], dtype=torch.int32)
    return torch.log_softmax(model(ids, pos, cu, return_logits=True).double(), -1)


def test_the_lora_reference_is_the_policy_with_adapters_off():
    from primerl.models.lora import LoRAError, adapters_disabled, merge_lora, unmerge_lora
    from primerl.runtime.policy import build_model
    from primerl.runtime.trainer import _rl

    t = Trainer(_cfg(*LORA), V)
    assert t.ref_model is t.model  # no copy of the base
    base = build_model(t.cfg, V).eval()  # the same seeded base, no adapters
    # the first step: the fresh adapters (B = 0) are the base, so the KL to it is 0; the second is not
    m0 = t.train_step(_payload(_samples(), 64))
    m1 = t.train_step(_payload(_samples(seed=1), 64))
    assert m0["loss/ref_kl"] == pytest.approx(0.0, abs=1e-12) and m1["loss/ref_kl"] > 0, (m0, m1)
    with torch.no_grad():  # adapters as a longer training leaves them
        for n, p in t.model.named_parameters():
            if n.endswith(("lora_B", "lora_B13", "lora_B2")):
                p.normal_(0, 0.1)
    ref = _rl.reference_logprobs(t.ref_model, _logprobs)
    assert (ref - _logprobs(base)).abs().max() < 1e-6
    assert t.model.training  # restored, and the adapters are on again
    with torch.no_grad():
        assert (_logprobs(t.model) - ref).abs().max() > 1e-2
    merge_lora(t.model)
    with pytest.raises(LoRAError, match="merged"), adapters_disabled(t.model):
        pass
    unmerge_lora(t.model)


def test_plan_counts_no_reference_copy_under_lora():
    from primerl.runtime.memory_plan import TrainerLayout

    assert TrainerLayout.from_config(_cfg(*LORA), "cpu").ref_model is False
    assert TrainerLayout.from_config(_cfg("--trainer.loss.ref_kl_coef", "1.0"), "cpu").ref_model is True


def _fsdp_case(rank, world_size, ref):
    t = Trainer(_cfg(*LORA, "--num_trainer_ranks", str(world_size)), V, rank=rank, world_size=world_size)
    assert t.fsdp and t.ref_model is t.model
    rows = [t.train_step(_ranked_payload(step, world_size, rank)) for step in range(len(ref))]
    return [f"step {i} {k}: {a[k]!r} != one process {b[k]!r}" for i, (a, b) in enumerate(zip(rows, ref))
            for k in ("loss", "loss/ref_kl") if not abs(a[k] - b[k]) <= 1e-5 * abs(b[k]) + 1e-7]


def _two_ranks(rank, world_size, log, ref):
    log.run("fsdp", _fsdp_case, rank, world_size, ref)


@pytest.mark.dist
def test_the_lora_reference_under_fsdp_matches_one_process(tmp_path):
    """FSDP2 on two gloo ranks runs the same sharded model as policy and (adapters off) reference in
    each micro-batch: the loss and the reference KL are the one-process numbers."""
    one = Trainer(_cfg(*LORA), V)
    ref = [one.train_step(_ranked_payload(step, 1, 0)) for step in range(3)]
    assert ref[-1]["loss/ref_kl"] > 0
    assert spawn(_two_ranks, 2, tmp_path, ref) == {"fsdp": []}
