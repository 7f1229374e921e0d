"""Built-in offline tasks over a small vocabulary: reverse a string of symbols.

Vocabulary: 0 PAD, 1 BOS, 2 SEP, then ``num_symbols`` symbols; the feedback task adds ``OK`` and
``WRONG`` after the symbols.
Prompt ``BOS s1..sK SEP``; the model answers with K tokens; reward is the fraction of positions
equal to the reversed input (so a random policy scores about 1/vocab_size).
"""

from __future__ import annotations

import math
import random

from .base import Environment, Episode, Prompt

PAD, BOS, SEP = 0, 1, 2
NUM_SPECIAL = 3


def _score(answer: list[int], target: list[int]) -> float:
    hits = sum(a == b for a, b in zip(answer, target))
    return hits / len(target)


class ReverseText(Environment):
    """Single-turn reverse-text.

    Lengths: ``min_length == max_length`` gives fixed K; otherwise ``length_dist`` picks
    ``uniform`` or ``lognormal`` (a long tail toward ``max_length``: most prompts short, a few long).
    ``distinct=True`` draws the symbols of a prompt without replacement while the length allows
    (K <= num_symbols), so each position is identified by its symbol: a two-layer model can then
    reverse by content (find the current token in the prompt, emit its predecessor) instead of
    by absolute position, which rotary-only models learn far more slowly.
    ``prefix_padding`` puts that many PAD tokens before BOS: the same task in long sequences
    (examples/long_context_4rank.toml pads each sample to 16k tokens for context parallelism).
    """

    def __init__(self, num_symbols: int = 8, min_length: int = 4, max_length: int = 4,
                 length_dist: str = "uniform", seed: int = 0, distinct: bool = False, prefix_padding: int = 0):
        if num_symbols < 2:
            raise ValueError(f"reverse-text: num_symbols must be >= 2, got {num_symbols}")
        if not 1 <= min_length <= max_length:
            raise ValueError(f"reverse-text: need 1 <= min_length <= max_length, got {min_length}, {max_length}")
        if length_dist not in ("uniform", "lognormal"):
            raise ValueError(f"reverse-text: length_dist must be 'uniform' or 'lognormal', got {length_dist!r}")
        self.num_symbols, self.min_length, self.max_length = num_symbols, min_length, max_length
        if isinstance(prefix_padding, bool) or not isinstance(prefix_padding, int) or prefix_padding < 0:
            raise ValueError(f"reverse-text: prefix_padding must be an int >= 0, got {prefix_padding!r}")
        self.length_dist, self.seed, self.distinct = length_dist, seed, distinct
        self.prefix_padding = prefix_padding
        self.vocab_size = NUM_SPECIAL + num_symbols
        self.max_new_tokens = max_length

    def _length(self, rng: random.Random) -> int:
        if self.min_length == self.max_length:
            return self.min_length
        if self.length_dist == "uniform":
            return rng.randint(self.min_length, self.max_length)
        span = self.max_length - self.min_length
        # lognormal with median ~ span/8: P(len near max) small but not negligible
        x = rng.lognormvariate(math.log(max(span / 8, 1.0)), 1.0)
        return self.min_length + min(int(x), span)

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + index)
        k = self._length(rng)
        if self.distinct and k <= self.num_symbols:
            symbols = [NUM_SPECIAL + s for s in rng.sample(range(self.num_symbols), k)]
        else:
            symbols = [NUM_SPECIAL + rng.randrange(self.num_symbols) for _ in range(k)]
        return Prompt(index, (PAD,) * self.prefix_padding + (BOS, *symbols, SEP), answer=symbols[::-1],
                      max_new_tokens=k)

    def reward(self, episode: Episode) -> float:
        return _score(episode.model_turns[-1], episode.prompt.answer)


class ReverseTextFeedback(ReverseText):
    """Two-attempt reverse-text: after the first answer the environment marks each position
    ``OK``/``WRONG`` (tokens ``NUM_SPECIAL + num_symbols`` and the next one, framed by ``SEP``), and the
    model answers again. A perfect first answer ends the episode. Reward: the score of the last answer."""

    max_turns = 2

    def __init__(self, num_symbols: int = 8, min_length: int = 4, max_length: int = 4,
                 length_dist: str = "uniform", seed: int = 0, distinct: bool = False, max_turns: int = 2):
        super().__init__(num_symbols, min_length, max_length, length_dist, seed, distinct)
        self.ok, self.wrong = NUM_SPECIAL + num_symbols, NUM_SPECIAL + num_symbols + 1
        self.vocab_size = NUM_SPECIAL + num_symbols + 2
        if max_turns < 1:
            raise ValueError(f"reverse-text-feedback: max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns

    def respond(self, episode: Episode) -> list[int] | None:
        answer, target = episode.model_turns[-1], episode.prompt.answer
        if _score(answer, target) == 1.0:
            return None
        marks = [self.ok if a == b else self.wrong for a, b in zip(answer, target)]
        marks += [self.wrong] * (len(target) - len(marks))
        return [SEP, *marks, SEP]
