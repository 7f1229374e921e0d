"""Environments: deterministic prompts, rewards, multi-turn feedback, loading by name and import path."""

import asyncio

import pytest

from primerl.rl.envs import (BUILTIN, Environment, Episode, Prompt, ReverseText, ReverseTextFeedback, Turn, call_env,
                             load_environment)
from primerl.rl.envs.reverse_text import NUM_SPECIAL, SEP


def test_reverse_text_prompts_are_deterministic_and_in_vocab():
    env = ReverseText(num_symbols=8, min_length=3, max_length=7, seed=3)
    a, b = env.prompt(11), env.prompt(11)
    assert a == b
    assert a.tokens[0] == 1 and a.tokens[-1] == SEP
    assert all(NUM_SPECIAL <= t < env.vocab_size for t in a.tokens[1:-1])
    assert a.max_new_tokens == len(a.tokens) - 2
    lengths = {len(env.prompt(i).tokens) - 2 for i in range(200)}
    assert lengths <= set(range(3, 8)) and len(lengths) > 2
    assert ReverseText(seed=4).prompt(11) != ReverseText(seed=3).prompt(11)


def test_lognormal_lengths_are_long_tailed():
    env = ReverseText(num_symbols=4, min_length=2, max_length=64, length_dist="lognormal")
    lens = sorted(len(env.prompt(i).tokens) - 2 for i in range(2000))
    median, p99 = lens[len(lens) // 2], lens[int(0.99 * len(lens))]
    assert 2 <= median <= 16 and p99 >= 3 * median and max(lens) <= 64


@pytest.mark.parametrize("answer_kind,expected", [("exact", 1.0), ("half", 0.5), ("none", 0.0), ("short", 0.25)])
def test_reverse_text_reward(answer_kind, expected):
    env = ReverseText(num_symbols=8, min_length=4, max_length=4)
    p = env.prompt(0)
    target = list(p.answer)
    wrong = [NUM_SPECIAL + (t - NUM_SPECIAL + 1) % 8 for t in target]
    answer = {"exact": target, "half": target[:2] + wrong[2:], "none": wrong, "short": target[:1]}[answer_kind]
    assert env.reward(Episode(p, [Turn("model", answer)])) == pytest.approx(expected)
    assert target == list(p.tokens[1:-1])[::-1]


def test_feedback_env_marks_positions_and_ends_on_success():
    env = ReverseTextFeedback(num_symbols=8, min_length=4, max_length=4)
    p = env.prompt(5)
    target = list(p.answer)
    OK, WRONG = env.ok, env.wrong
    assert env.vocab_size == WRONG + 1 == NUM_SPECIAL + 8 + 2
    first = target[:2] + [target[3], target[2]] if target[2] != target[3] else target[:2] + [OK, OK]
    ep = Episode(p, [Turn("model", first)])
    reply = env.respond(ep)
    assert reply[0] == SEP and reply[-1] == SEP and reply[1:3] == [OK, OK] and set(reply[3:5]) == {WRONG}
    ep.turns.append(Turn("env", reply))
    ep.turns.append(Turn("model", target))
    assert env.reward(ep) == 1.0
    assert ep.loss_mask == [False] * len(p.tokens) + [True] * 4 + [False] * len(reply) + [True] * 4
    assert env.respond(Episode(p, [Turn("model", target)])) is None


def test_load_builtin_and_import_path():
    assert isinstance(load_environment("reverse-text", num_symbols=5), ReverseText)
    env = load_environment("primerl.rl.envs.reverse_text:ReverseTextFeedback", max_turns=3)
    assert env.max_turns == 3
    assert set(BUILTIN) >= {"reverse-text", "reverse-text-feedback"}


@pytest.mark.parametrize("env_id,args,match", [
    ("reverse-txt", {}, "unknown environment"),
    ("no_such_module_xyz:Env", {}, "cannot import"),
    ("primerl.rl.envs.reverse_text:Nope", {}, "has no attribute"),
    ("reverse-text", {"num_symbol": 3}, r"unknown argument.*num_symbol"),
    ("reverse-text", {"num_symbols": 1}, "num_symbols must be >= 2"),
])
def test_load_errors_are_specific(env_id, args, match):
    with pytest.raises(ValueError, match=match):
        load_environment(env_id, **args)


class AsyncEnv(Environment):
    vocab_size = 10

    def prompt(self, index):
        return Prompt(index, (1, 2))

    async def reward(self, episode):
        await asyncio.sleep(0)
        return 0.5


def test_async_env_methods_are_awaited_with_timeout():
    env = AsyncEnv()
    assert call_env(env.reward, Episode(env.prompt(0)), timeout=1.0) == 0.5

    async def slow(_):
        await asyncio.sleep(5)

    with pytest.raises(asyncio.TimeoutError):
        call_env(slow, None, timeout=0.05)


def test_distinct_symbols_option():
    env = ReverseText(num_symbols=5, min_length=3, max_length=7, distinct=True)
    for i in range(100):
        sym = env.prompt(i).tokens[1:-1]
        if len(sym) <= 5:
            assert len(set(sym)) == len(sym)
    repeats = ReverseText(num_symbols=5, min_length=5, max_length=5)
    assert any(len(set(repeats.prompt(i).tokens[1:-1])) < 5 for i in range(50))
