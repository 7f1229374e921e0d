"""Protocol edge cases of turning a verifiers branch into a sample (stand-in branch objects with
the fields ``vf.Branch`` has; the real branches are exercised in tests/vf through the job)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from primerl.rl.envs.verifiers_env import BranchError, branch_sample, check_branch_against_requests, sampled_spans


def _branch(ids, mask, logprobs, routing=None):
    nodes = [SimpleNamespace(mask=mask, logprobs=[lp for lp, m in zip(logprobs, mask) if m])]
    return SimpleNamespace(index=0, token_ids=ids, sampled_mask=mask, logprobs=logprobs, nodes=nodes,
                           routed_experts=routing)


# prompt 1 2 3, model turn 4 5, tool reply 6 7, model turn 8 9
IDS = [1, 2, 3, 4, 5, 6, 7, 8, 9]
MASK = [False, False, False, True, True, False, False, True, True]
LPS = [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0, -2.0]
REQS = [([1, 2, 3], [4, 5], [-0.5, -0.25]), ([1, 2, 3, 4, 5, 6, 7], [8, 9], [-1.0, -2.0])]


def test_spans():
    assert sampled_spans(MASK) == [(3, 5), (7, 9)]
    assert sampled_spans([True, True]) == [(0, 2)] and sampled_spans([]) == []


def test_branch_matching_the_servers_record_passes():
    check_branch_against_requests(_branch(IDS, MASK, LPS), REQS)


@pytest.mark.parametrize("edit, needle", [
    (lambda ids, lps: (ids[:4] + [9] + ids[5:], lps), "not what the inference server sampled"),  # model token edited
    # env tokens differ from the prompt sent
    (lambda ids, lps: (ids[:5] + [6, 6] + ids[7:], lps), "not what the inference server sampled"),
    (lambda ids, lps: (ids, lps[:7] + [-1.0, -2.5]), "log-probs"),
])
def test_a_branch_that_differs_from_what_was_sampled_is_refused(edit, needle):
    ids, lps = edit(list(IDS), list(LPS))
    with pytest.raises(BranchError, match=needle):
        check_branch_against_requests(_branch(ids, MASK, lps), REQS)


def test_branch_sample_fields():
    routing = np.arange(9 * 2 * 2, dtype=np.uint8).reshape(9, 2, 2)
    s = branch_sample(_branch(IDS, MASK, LPS, routing), advantage=0.5, temperature=0.7, replay=True, vocab_size=10)
    assert s.input_ids.tolist() == IDS and s.loss_mask.tolist() == MASK
    assert s.inference_logprobs.tolist() == LPS and s.advantages == 0.5 and s.temperature == 0.7
    assert torch.equal(s.replay_ids, torch.from_numpy(routing))
    with pytest.raises(BranchError, match="no routed experts"):
        branch_sample(_branch(IDS, MASK, LPS), advantage=0.0, temperature=1.0, replay=True, vocab_size=10)
    with pytest.raises(BranchError, match="outside the policy's vocabulary"):
        branch_sample(_branch(IDS, MASK, LPS), advantage=0.0, temperature=1.0, replay=False, vocab_size=9)
    with pytest.raises(BranchError, match="routed experts for 8 of 9"):
        branch_sample(_branch(IDS, MASK, LPS, routing[:8]), advantage=0.0, temperature=1.0, replay=True, vocab_size=10)
    with pytest.raises(BranchError, match="no sampled token"):
        branch_sample(_branch(IDS, [False] * 9, LPS), advantage=0.0, temperature=1.0, replay=False, vocab_size=10)
