"""GLM-5's sparse MLA (glm_moe_dsa) picks its dense or sparse form by the batch's longest sequence.
Given as ``max_seqlen`` (from where the batch is built), the model's forward and backward read
nothing on the host, with results bitwise those of the forward that reads it from ``cu_seqlens``."""

from __future__ import annotations

import pytest
import torch

from primerl.kernels import debug_checks
from primerl.kernels.testing import assert_bitwise_equal, count_host_reads
from primerl.models import MoETransformer, MoETransformerConfig

from models_testing import hf_tiny

INDEX_TOPK = 6


@pytest.fixture(scope="module")
def model():
    hf = hf_tiny("GlmMoeDsa", 4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_group=2,
                 topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                 q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16,
                 index_topk=INDEX_TOPK, index_head_dim=16, index_n_heads=8,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    m = MoETransformer(MoETransformerConfig.from_hf(hf.config.to_dict()))
    m.init_weights(seed=3)
    assert m.config.is_sparse
    return m


def _batch(vocab, lens, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return ids, pos, cu


def _step(model, ids, pos, cu, **kw):
    model.zero_grad(set_to_none=True)
    logits = model(ids, pos, cu, return_logits=True, **kw)
    w = torch.linspace(-1.0, 1.0, logits.numel()).view(logits.shape)
    (logits * w).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# (5, 1, 17, 3, 9): two sequences longer than index_topk, so the sparse form runs; (5, 1, 6, 3): dense
@pytest.mark.parametrize("lens", [(5, 1, 17, 3, 9), (5, 1, 6, 3)], ids=["sparse", "dense"])
def test_forward_backward_without_host_reads_is_bitwise(model, lens):
    ids, pos, cu = _batch(model.config.vocab_size, lens, seed=len(lens))
    with debug_checks(False), count_host_reads() as before:
        want_logits, want_grads = _step(model, ids, pos, cu)
    assert before.total == 1, f"expected the one read of the longest sequence, got {before.counts} at {before.where}"
    with debug_checks(False), count_host_reads() as reads:
        got_logits, got_grads = _step(model, ids, pos, cu, max_seqlen=max(lens))
    assert reads.total == 0, f"host reads: {reads.counts} at {reads.where}"
    assert_bitwise_equal(got_logits, want_logits, "logits")
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 20
    for name, g in got_grads.items():
        assert_bitwise_equal(g, want_grads[name], name)


def test_wrong_max_seqlen_is_caught(model):
    ids, pos, cu = _batch(model.config.vocab_size, (5, 1, 17), seed=0)
    with pytest.raises(ValueError, match="max_seqlen must equal the longest sequence"):  # debug mode: the values
        model(ids, pos, cu, max_seqlen=16)
    with debug_checks(False), pytest.raises(RuntimeError, match="max_seqlen must equal the longest sequence"):
        model(ids, pos, cu, max_seqlen=18)
    with pytest.raises(ValueError, match="max_seqlen must be a non-negative int"):
        model(ids, pos, cu, max_seqlen=17.0)


@pytest.mark.no_poison  # dynamo would trace into the tests' poisoned torch.empty (see tests/kernels)
def test_forward_compiles_fullgraph_with_max_seqlen(model):
    """The longest sequence no longer needs a host read, so the sparse model's forward is one graph."""
    ids, pos, cu = _batch(model.config.vocab_size, (5, 1, 17, 3, 9), seed=7)

    def fn(ids, pos, cu):
        return model(ids, pos, cu, return_logits=True, max_seqlen=17)

    torch._dynamo.reset()
    with debug_checks(False), torch.no_grad():
        got = torch.compile(fn, backend="aot_eager", fullgraph=True)(ids, pos, cu)
        want = fn(ids, pos, cu)
    torch._dynamo.reset()
    assert_bitwise_equal(got, want, "compiled logits")
