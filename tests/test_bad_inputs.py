"""Issue 16's hostile-user inputs across the layers: each gets a clear error naming the argument
(and the expected and actual value) before any work starts, never a raw torch error."""

import pytest
import torch

from primerl.kernels.fp8 import quant_per_block, quant_per_token_group
from primerl.kernels.fp8_training import fp8_linear
from primerl.kernels.moe import topk_route
from primerl.models import CheckpointError, MoETransformer, MoETransformerConfig
from primerl.rl import drgrpo, grpo, policy_loss, rloo


@pytest.mark.parametrize("call, message", [
    (lambda: grpo(torch.tensor([1.0, 0.0, 1.0, 0.0]), 2.0), "grpo: group_size must be an int, got float 2.0"),
    (lambda: drgrpo(torch.ones(4), True), "drgrpo: group_size must be an int, got bool True"),
    (lambda: rloo(torch.ones(4), "2"), "rloo: group_size must be an int, got str '2'"),
    (lambda: quant_per_token_group(torch.randn(2, 256), 128.0),
     "quant_per_token_group: group_size must be an int, got float 128.0"),
    (lambda: quant_per_block(torch.randn(128, 128), (128.0, 128)), "quant_per_block: block_size must be an int"),
    (lambda: topk_route(torch.randn(3, 4), 2.0), "topk_route: top_k must be an int, got float 2.0"),
    (lambda: topk_route(torch.randn(3, 4), 2, n_groups=1.0), "topk_route: n_groups must be an int"),
])
def test_float_sizes_are_type_errors_naming_the_argument(call, message):
    with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


@pytest.mark.parametrize("rewards", [["0.5", "1", "0", "1"], [0.5, None, 1.0, 0.0]])
def test_rewards_that_are_not_numbers(rewards):
    # where rewards enter the job, primerl.runtime.orchestrator.env_calls.check_reward rejects them (tested there)
    with pytest.raises(TypeError, match="grpo: rewards must be real numbers"):
        grpo(rewards, 2)


def test_integer_sizes_of_other_int_types_still_work():
    import numpy as np

    assert grpo(torch.tensor([1.0, 0.0, 1.0, 0.0]), np.int64(2)).advantages.shape == (4,)
    assert topk_route(torch.randn(3, 4), np.int32(2))[0].shape == (3, 2)


def test_fp8_linear_bias_of_the_wrong_shape():
    x, w = torch.randn(4, 128), torch.randn(256, 128)
    with pytest.raises(ValueError,
                       match=r"fp8_linear: bias must be a tensor of shape \[N\] = \(256,\) on cpu, got \(128,\)"):
        fp8_linear(x, w, torch.randn(128))
    with pytest.raises(ValueError, match=r"fp8_linear: bias .* got \(1, 256\)"):
        fp8_linear(x, w, torch.randn(1, 256))
    y = fp8_linear(x, w, torch.randn(256))
    assert y.shape == (4, 256) and torch.isfinite(y).all()


def _loss_inputs(T=6):
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(T, generator=g)
    return lp, lp + 0.01, torch.randn(T, generator=g), torch.ones(T, dtype=torch.bool)


def test_policy_loss_rejects_a_fractional_mask_and_mixed_devices():
    lp, ilp, adv, mask = _loss_inputs()
    with pytest.raises(ValueError,
                       match=r"a float/int loss_mask must hold only 0 and 1 .*loss_weights=.*loss_mask.bool\(\)"):
        policy_loss(lp, ilp, adv, torch.full((6,), 0.5))
    with pytest.raises(ValueError, match="advantages is on meta but logprobs is on cpu"):
        policy_loss(lp, ilp, adv.to("meta"), mask)
    loss, _ = policy_loss(lp, ilp, adv, mask)
    assert torch.isfinite(loss)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoETransformer(MoETransformerConfig.tiny(vocab_size=64)).eval()


def test_token_ids_outside_the_vocabulary(model):
    pos, cu = torch.tensor([0, 1, 2]), torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError,
                       match=r"input_ids must be in \[0, vocab_size\): vocab_size=64, got values in \[0, 64\]"):
        model(torch.tensor([0, 5, 64]), pos, cu)
    with pytest.raises(ValueError, match=r"got values in \[-1, 5\]"):
        model(torch.tensor([-1, 5, 3]), pos, cu)


def test_position_ids_that_contradict_cu_seqlens(model):
    ids, cu = torch.tensor([3, 4, 5, 6, 7, 8, 9]), torch.tensor([0, 3, 7], dtype=torch.int32)
    good = model(ids, torch.tensor([0, 1, 2, 0, 1, 2, 3]), cu, return_logits=True)
    with pytest.raises(ValueError, match=r"position_ids contradict cu_seqlens: "
                                         r".*cu_seqlens \[0, 3, 7\]; index 3 has 3, expected 0"):
        model(ids, torch.arange(7), cu)
    with pytest.raises(ValueError, match="index 1 has 2, expected 1"):
        model(ids, torch.tensor([0, 2, 3, 0, 1, 2, 3]), cu)
    assert torch.isfinite(good).all()


def test_corrupt_safetensors_error_names_the_file(model, tmp_path):
    model.save_pretrained(tmp_path)
    shard = next(tmp_path.glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[:8] + b"\xff" * 8 + data[16:])  # a header that cannot be parsed
    with pytest.raises(CheckpointError, match=f"{shard}: not a readable safetensors file"):
        MoETransformer.from_pretrained(tmp_path)
