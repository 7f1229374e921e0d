"""distill.topk through the trainer: the teacher's top-k rows ride in the batch and the trainer adds
topk_coef * the forward KL from them to the student, with the gradient of that KL over the whole
vocabulary (brute force: the model's full log-softmax)."""

from dataclasses import replace

import pytest
import torch

from test_trainer import V, _cfg, _payload, _samples

from primerl.rl import topk_distill_kl
from primerl.rl.packing import pack
from primerl.runtime.trainer import Trainer
from trainer_testing import grad_gap, record_grads

K, COEF = 3, 0.7


def _with_teacher_topk(samples, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in samples:
        L = len(s)
        ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(L)])
        lps = torch.log_softmax(torch.randn(L, V, generator=g) * 2, -1).gather(1, ids)
        out.append(replace(s, teacher_topk_ids=ids, teacher_topk_logprobs=lps))
    return out


def _cfg_topk(*over):
    cfg = _cfg("--trainer.max_grad_norm", "0", *over)
    cfg.distill.topk, cfg.distill.topk_coef = K, COEF  # the trainer's side of [distill] (no teacher needed here)
    return cfg


def _brute_force_kl(model, samples, cfg):
    """sum over loss tokens of the renormalised top-k forward KL, from the full log-softmax of each
    sequence's logits (entry t: the prediction at t - 1), and the number of loss tokens."""
    total, n = 0.0, 0
    for s in samples:
        mb = pack([s], len(s), 1, pad_to_seq_len=False)[0][0]
        replay = mb.replay_ids if cfg.trainer.router_replay else None
        hidden = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, replay_ids=replay)
        logp = torch.log_softmax((hidden.float() @ model.lm_head.weight.float().T) / s.temperature, -1)
        student = logp[:-1].gather(1, s.teacher_topk_ids[1:])  # token t from the hidden state at t - 1
        total = total + topk_distill_kl(student, s.teacher_topk_logprobs[1:], s.loss_mask[1:]).sum()
        n += int(s.loss_mask[1:].sum())
    return total, n


def test_trainer_adds_the_topk_term_with_its_full_vocabulary_gradient():
    samples = _with_teacher_topk(_samples(6))
    with_term, without = Trainer(_cfg_topk(), V), Trainer(_cfg("--trainer.max_grad_norm", "0"), V)
    ga, gb = record_grads(with_term), record_grads(without)
    ma = with_term.train_step(_payload(samples, 64))
    mb = without.train_step(_payload(samples, 64))
    assert "loss/distill_topk_kl" not in mb
    ref = Trainer(_cfg_topk(), V)  # the same initial weights: the brute force runs on them
    kl_sum, n = _brute_force_kl(ref.model, samples, ref.cfg)
    assert ma["loss/distill_topk_kl"] == pytest.approx(float(kl_sum.detach()) / n, rel=1e-4)
    assert ma["loss"] - mb["loss"] == pytest.approx(COEF * float(kl_sum.detach()) / n, rel=1e-4)
    (COEF * kl_sum / n).backward()
    g_ref = {name: p.grad for name, p in ref.model.named_parameters() if p.grad is not None}
    diff = {name: ga[0][name] - gb[0][name] for name in g_ref}
    assert grad_gap(g_ref, diff) < 1e-4, "the trainer's top-k gradient differs from the full-vocabulary one"


def test_packing_does_not_change_the_topk_term():
    """One micro-batch or several: the same KL metric and the same gradients (normalised by the step's
    loss tokens, not a micro-batch's)."""
    samples = _with_teacher_topk(_samples(6))
    a, b = Trainer(_cfg_topk(), V), Trainer(_cfg_topk(), V)
    ga, gb = record_grads(a), record_grads(b)
    ma, mb = a.train_step(_payload(samples, 64)), b.train_step(_payload(samples, 10))
    assert ma["loss/distill_topk_kl"] == pytest.approx(mb["loss/distill_topk_kl"], rel=1e-5)
    assert grad_gap(ga[0], gb[0]) < 1e-5
