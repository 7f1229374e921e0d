"""Environments' prompt datasets (``prompts()`` with ids), held-out splits and the copy-text task."""

import pytest

from primerl.rl.envs import CopyText, Episode, Environment, Prompt, ReverseText, Turn, load_environment, prompt_ids
from primerl.rl.envs.reverse_text import BOS, SEP


def test_unbounded_generator_declares_no_dataset_and_keeps_its_prompts():
    env = ReverseText(num_symbols=8)
    assert env.prompts() is None and prompt_ids(env) is None
    # the same strings as before datasets existed: index i's rng draws the symbols
    import random
    rng = random.Random(0 * 1_000_003 + 5)
    want = [3 + rng.randrange(8) for _ in range(4)]
    assert list(env.prompt(5).tokens[1:-1]) == want


def test_finite_dataset_ids_are_distinct_strings_in_index_order():
    env = ReverseText(num_symbols=4, num_prompts=40, seed=2)
    ids = prompt_ids(env)
    assert len(ids) == 40 == len(set(ids))
    for i in (0, 7, 39):
        p = env.prompt(i)
        assert p.key == ids[i] == ReverseText.string_id(p.tokens[1:-1])
    assert env.prompt(40).tokens == env.prompt(0).tokens  # the dataset wraps
    with pytest.raises(ValueError, match="num_prompts = 300 exceeds"):
        ReverseText(num_symbols=2, min_length=3, max_length=3, num_prompts=300).prompts()


def test_heldout_split_never_shares_a_string_with_train():
    kw = dict(num_symbols=4, heldout_fraction=0.2)
    train = {ReverseText(**kw, seed=0).prompt(i).key for i in range(600)}
    held = {ReverseText(**kw, seed=1, split="heldout").prompt(i).key for i in range(300)}
    assert held and train and not (held & train)
    assert all(ReverseText(**kw).is_heldout([3 + "abcd".index(c) for c in k]) for k in held)
    with pytest.raises(ValueError, match="heldout_fraction"):
        ReverseText(split="heldout")


def test_copy_text_marks_its_prompt_and_rewards_the_copy():
    env = load_environment("copy-text", num_symbols=8)
    assert isinstance(env, CopyText)
    p = env.prompt(3)
    assert p.tokens[:2] == (BOS, SEP) and p.tokens[-1] == SEP
    s = list(p.tokens[2:-1])
    assert env.reward(Episode(p, [Turn("model", s)])) == 1.0
    assert env.reward(Episode(p, [Turn("model", s[::-1])])) < 1.0 or s == s[::-1]
    assert ReverseText().prompt(3).tokens[1] != SEP


def test_base_class_lists_ids_of_a_finite_dataset_and_checks_them():
    class Two(Environment):
        vocab_size, num_prompts = 4, 2

        def prompt(self, i):
            return Prompt(i, (1, 2), id=("x", "y")[i])

    class Dup(Two):
        def prompt(self, i):
            return Prompt(i, (1, 2), id="same")

    assert prompt_ids(Two()) == ["x", "y"]
    with pytest.raises(ValueError, match="unique"):
        prompt_ids(Dup())
