"""A non-finite policy never leaves the trainer, and the sampler names non-finite logits."""

import pytest
import torch
from test_trainer import V, _cfg, _payload, _samples

from primerl.runtime.inference.engine import InferenceEngine, NonFiniteLogitsError, Request, SamplingParams, sample_next
from primerl.runtime.trainer.guards import NonFiniteParametersError, check_finite_parameters
from primerl.runtime.policy import build_model
from primerl.runtime.trainer import Trainer


def test_check_finite_parameters_names_the_first_bad_one():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    check_finite_parameters(model, 0)
    with torch.no_grad():
        model[1].bias[1] = float("inf")
    with pytest.raises(NonFiniteParametersError, match=r"step 7: .*non-finite \(NaN/inf; first: 1.bias\)"):
        check_finite_parameters(model, 7)


def test_an_update_that_makes_the_weights_non_finite_stops_the_step():
    # A finite config can still overflow the weights (an lr near float32's max): stand in for it
    # with an optimizer step that writes an inf. (lr = inf itself is refused by the config.)
    t = Trainer(_cfg(), V)
    real_step = t.optimizer.step

    def overflowing_step():
        real_step()
        with torch.no_grad():
            t.model.norm.weight[0] = float("inf")

    t.optimizer.step = overflowing_step
    with pytest.raises(NonFiniteParametersError,
                       match="step 0: .*first: norm.weight.*neither published nor checkpointed"):
        t.train_step(_payload(_samples(), seq_len=64))
    ok = Trainer(_cfg(), V)
    ok.train_step(_payload(_samples(), seq_len=64))  # the real update of the same batch passes the check


def test_sampler_raises_on_non_finite_logits_instead_of_indexing_minus_one():
    logits = torch.randn(3, 10)
    logits[1, 4] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match=r"logits of 1 of 3 rows are not finite \(NaN/inf; rows \[1\]\)"):
        sample_next(logits, [1.0] * 3, [1.0] * 3, [0.5] * 3)
    tok, lp = sample_next(torch.randn(3, 10), [1.0] * 3, [1.0] * 3, [0.5] * 3)
    assert tok.shape == (3,) and torch.isfinite(lp).all()


def test_engine_with_nan_weights_reports_the_policy_version():
    model = build_model(_cfg(), V)
    engine = InferenceEngine(model, max_batch_size=2)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["lm_head.weight"][0, 0] = float("nan")
    engine.load_weights(sd, 3)
    engine.add_request(Request(0, [1, 2, 3], SamplingParams(max_new_tokens=2, seed=0)))
    with pytest.raises(NonFiniteLogitsError, match=r"not finite .*\(policy version 3\)"):
        engine.step()
