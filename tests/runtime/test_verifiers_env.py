"""The optional verifiers adapter against a local fake with the same surface (verifiers itself is
not installed): prompts through the chat template, multi-turn episodes (env turns, completion,
state), rubric rewards, single-turn and completion-type envs, loading by import path, and a short
orchestrator run on the embedded engine."""

import threading

import pytest
import torch

from primerl.rl.envs import Episode, Turn, call_env, load_environment
from primerl.rl.envs.verifiers_env import VerifiersEnvironment, from_verifiers

from orchestrator_testing import run_orchestrator_with_stub_trainer

SPECIAL = ["<pad>", "<bos>", "<eos>", "<system>", "<user>", "<assistant>"]
CHARS = "abcdefghijklmnopqrstuvwxyz ?"


class CharTokenizer:
    """A Hugging Face-shaped tokenizer over single characters."""

    eos_token_id = 2

    def __len__(self):
        return len(SPECIAL) + len(CHARS)

    def encode(self, text, add_special_tokens=True):
        return [len(SPECIAL) + CHARS.index(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(CHARS[i - len(SPECIAL)] if i >= len(SPECIAL) else ("" if skip_special_tokens else SPECIAL[i])
                       for i in ids)

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        out = []
        for m in messages:
            out += [SPECIAL.index(f"<{m['role']}>")] + self.encode(m["content"]) + [self.eos_token_id]
        return out + ([SPECIAL.index("<assistant>")] if add_generation_prompt else [])


class Score:
    def __init__(self, reward):
        self.reward = reward


class FakeRubric:
    def __init__(self):
        self.calls = []

    async def score_rollout(self, prompt, completion, answer, state, task=None, info=None):
        self.calls.append({"prompt": prompt, "completion": completion, "answer": answer, "state": state, "task": task})
        last = completion if isinstance(completion, str) else [m for m in completion if m["role"] == "assistant"][-1]["content"]
        return Score(1.0 if last.strip() == answer else 0.0)


class FakeGuessEnv:
    """A verifiers-style MultiTurnEnv: the model guesses; a wrong guess gets "no" and another turn."""

    message_type = "chat"
    system_prompt = "reverse"
    max_turns = 3

    def __init__(self):
        self.dataset = [{"question": "abc", "answer": "cba", "task": "rev"},
                        {"prompt": [{"role": "user", "content": "xy"}], "answer": "yx", "task": "rev"}]
        self.rubric = FakeRubric()

    async def setup_state(self, state):
        state["setup"] = True
        return state

    async def is_completed(self, messages, state):
        return messages[-1]["role"] == "assistant" and messages[-1]["content"] == state["answer"]

    def env_response(self, messages, state):
        state["misses"] = state.get("misses", 0) + 1
        return {"role": "user", "content": "no"}, state


def _env(**kw):
    return VerifiersEnvironment(FakeGuessEnv(), CharTokenizer(), max_new_tokens=8, **kw)


def test_prompts_go_through_the_chat_template():
    env, tok = _env(), CharTokenizer()
    p = env.prompt(0)
    assert list(p.tokens) == tok.apply_chat_template([{"role": "system", "content": "reverse"},
                                                      {"role": "user", "content": "abc"}], add_generation_prompt=True)
    assert env.prompt(1).tokens == tuple(tok.apply_chat_template([{"role": "user", "content": "xy"}],
                                                                  add_generation_prompt=True))
    assert env.prompt(2).tokens == env.prompt(0).tokens and env.prompt(0) == env.prompt(0) and env.num_prompts == 2
    assert env.vocab_size == len(tok) and env.stop_token_ids == (2,) and env.max_turns == 3 and p.max_new_tokens == 8


def test_multi_turn_episode_env_turns_state_and_reward():
    env, tok = _env(), CharTokenizer()
    ep = Episode(env.prompt(0))
    ep.turns.append(Turn("model", tok.encode("abc") + [2]))
    reply = call_env(env.respond, ep, timeout=5)
    assert reply == tok.apply_chat_template([{"role": "user", "content": "no"}], add_generation_prompt=True)
    ep.turns.append(Turn("env", reply))
    ep.turns.append(Turn("model", tok.encode("cba") + [2]))
    assert call_env(env.respond, ep, timeout=5) is None  # is_completed
    assert call_env(env.reward, ep, timeout=5) == 1.0
    call = env.vf_env.rubric.calls[-1]
    assert call["completion"] == [{"role": "assistant", "content": "abc"}, {"role": "user", "content": "no"},
                                  {"role": "assistant", "content": "cba"}]
    assert call["state"]["setup"] and call["state"]["misses"] == 1 and call["state"]["turn"] == 2
    assert call["task"] == "rev" and call["answer"] == "cba"
    assert env._live == {}  # the conversation is dropped once scored
    wrong = Episode(env.prompt(1), [Turn("model", tok.encode("xy"))])
    assert call_env(env.reward, wrong, timeout=5) == 0.0


def test_single_turn_and_completion_type():
    class Single:
        message_type = "completion"
        dataset = [{"question": "ab", "answer": "ba"}]
        rubric = FakeRubric()

    tok = CharTokenizer()
    env = VerifiersEnvironment(Single(), tok)
    p = env.prompt(0)
    assert list(p.tokens) == tok.encode("ab") and env.max_turns == 1
    ep = Episode(p, [Turn("model", tok.encode("ba"))])
    assert call_env(env.respond, ep, timeout=5) is None
    assert call_env(env.reward, ep, timeout=5) == 1.0
    assert Single.rubric.calls[-1]["completion"] == "ba" and Single.rubric.calls[-1]["prompt"] == "ab"


def test_bad_environments_are_rejected():
    class NoRubric:
        dataset = []

    with pytest.raises(TypeError, match="rubric.score_rollout"):
        VerifiersEnvironment(NoRubric(), CharTokenizer())
    unbounded = FakeGuessEnv()
    unbounded.max_turns = -1
    with pytest.raises(ValueError, match="max_turns"):
        VerifiersEnvironment(unbounded, CharTokenizer())
    assert VerifiersEnvironment(unbounded, CharTokenizer(), max_turns=4).max_turns == 4
    with pytest.raises(ImportError, match="optional 'verifiers'"):
        from_verifiers("wordle", "some/tokenizer")


def test_loaded_by_import_path_and_concurrent_episodes():
    env = load_environment("primerl.rl.envs.verifiers_env:VerifiersEnvironment", vf_env=FakeGuessEnv(),
                           tokenizer=CharTokenizer(), max_new_tokens=4)
    tok = CharTokenizer()
    eps = [Episode(env.prompt(i % 2), [Turn("model", tok.encode("cba" if i % 2 == 0 else "q"))]) for i in range(8)]
    out = [None] * 8

    def run(i):
        out[i] = (call_env(env.respond, eps[i], timeout=5), call_env(env.reward, eps[i], timeout=5))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [r for _, r in out] == [1.0 if i % 2 == 0 else 0.0 for i in range(8)]
    assert [reply is None for reply, _ in out] == [i % 2 == 0 for i in range(8)]
    assert env._live == {}


def test_orchestrator_runs_a_verifiers_environment(tmp_path):
    """Two steps of the real orchestrator (embedded engine, random tiny policy) over the adapter."""
    from primerl.models.config import MoETransformerConfig
    from primerl.models.transformer import MoETransformer
    from primerl.runtime.config import load_config
    from primerl.runtime.transport import FileTransport

    env = _env()
    cfg = load_config(None, ["--output_dir", str(tmp_path), "--max_steps", "2", "--orchestrator.batch_size", "2",
                             "--orchestrator.group_size", "2", "--orchestrator.max_async_level", "0",
                             "--model.dim", "32", "--model.moe_dim", "16", "--model.n_layers", "1"])
    model = MoETransformer(MoETransformerConfig.tiny(vocab_size=env.vocab_size, dim=32, moe_dim=16, n_layers=1))
    tr = FileTransport(tmp_path)
    seen = run_orchestrator_with_stub_trainer(cfg, env, model, tr)
    assert [p["step"] for p in seen] == [0, 1]
    mbs = seen[0]["micro_batches"]
    assert sum(int(mb.loss_mask.sum()) for mb in mbs) > 0
    assert all(torch.isfinite(mb.advantages).all() for mb in mbs)
