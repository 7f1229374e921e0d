"""Built-in offline tasks over a small vocabulary: reverse a string of symbols.

Vocabulary: 0 PAD, 1 BOS, 2 SEP, then ``num_symbols`` symbols; the feedback task adds ``OK`` and
``WRONG`` after the symbols.
Prompt ``BOS s1..sK SEP``; the model answers with K tokens; reward is the fraction of positions
equal to the reversed input (so a random policy scores about 1/vocab_size). ``copy-text`` (the
second task of a mix, ``examples/reverse_text_mix.toml``) asks for the string itself, its prompt
marked by a SEP after BOS: ``BOS SEP s1..sK SEP``.

Datasets and held-out strings: ``num_prompts = N`` makes the environment a dataset of the first N
distinct strings its generator draws (``prompts()`` lists their ids, the strings as letters,
``"dbca"``); unset, it is an unbounded generator (``prompts()`` is None). ``heldout_fraction``
splits the space of strings by a hash of the string (not of the seed or index): ``split =
"train"`` draws only strings outside the held-out part, ``split = "heldout"`` only strings inside
it, so an eval environment with ``split = "heldout"`` never sees a string the training one can draw.
"""

from __future__ import annotations

import math
import random
import zlib

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

    task = "reverse"

    def __init__(self, num_symbols: int = 8, min_length: int = 4, max_length: int = 4,
                 length_dist: str = "uniform", seed: int = 0, distinct: bool = False, prefix_padding: int = 0,
                 num_prompts: int | None = None, split: str = "train", heldout_fraction: float = 0.0):
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
        if split not in ("train", "heldout"):
            raise ValueError(f"reverse-text: split must be 'train' or 'heldout', got {split!r}")
        if not 0.0 <= heldout_fraction < 1.0 or (split == "heldout" and heldout_fraction <= 0.0):
            raise ValueError(f"reverse-text: heldout_fraction must be in [0, 1) (> 0 for split = 'heldout'), "
                             f"got {heldout_fraction}")
        if num_prompts is not None and (isinstance(num_prompts, bool) or int(num_prompts) < 1):
            raise ValueError(f"reverse-text: num_prompts must be >= 1 (or unset: unbounded), got {num_prompts!r}")
        self.split, self.heldout_fraction = split, float(heldout_fraction)
        self.num_prompts = None if num_prompts is None else int(num_prompts)
        self._dataset: list[list[int]] | None = None

    def is_heldout(self, symbols) -> bool:
        """Whether a string (symbol ids) lies in the held-out part of the string space."""
        h = zlib.crc32(bytes(int(s) - NUM_SPECIAL for s in symbols)) / 2**32
        return h < self.heldout_fraction

    def _in_split(self, symbols) -> bool:
        return self.heldout_fraction == 0.0 or self.is_heldout(symbols) == (self.split == "heldout")

    def _draw(self, index: int) -> list[int]:
        """The generator's string number ``index`` within the split (rejection keeps it deterministic)."""
        rng = random.Random(self.seed * 1_000_003 + index)
        for _ in range(10_000):
            k = self._length(rng)
            if self.distinct and k <= self.num_symbols:
                symbols = [NUM_SPECIAL + s for s in rng.sample(range(self.num_symbols), k)]
            else:
                symbols = [NUM_SPECIAL + rng.randrange(self.num_symbols) for _ in range(k)]
            if self._in_split(symbols):
                return symbols
        raise ValueError(f"reverse-text: no string of split {self.split!r} in 10000 draws "
                         f"(heldout_fraction {self.heldout_fraction})")

    def _strings(self) -> list[list[int]]:
        """The dataset: the first ``num_prompts`` distinct strings of the generator."""
        if self._dataset is None:
            out, seen, j = [], set(), 0
            while len(out) < self.num_prompts:
                if j > 50 * self.num_prompts + 1000:
                    raise ValueError(f"reverse-text: num_prompts = {self.num_prompts} exceeds the distinct strings "
                                     f"this split can draw ({len(out)} found)")
                s = self._draw(j)
                j += 1
                if tuple(s) not in seen:
                    seen.add(tuple(s))
                    out.append(s)
            self._dataset = out
        return self._dataset

    @staticmethod
    def string_id(symbols) -> str:
        return "".join(chr(ord("a") + int(s) - NUM_SPECIAL) if int(s) - NUM_SPECIAL < 26 else f"<{int(s)}>"
                       for s in symbols)

    def prompts(self) -> list[str] | None:
        return None if self.num_prompts is None else [self.string_id(s) for s in self._strings()]

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
        if self.num_prompts is None:
            symbols = self._draw(index)
        else:
            symbols = self._strings()[index % self.num_prompts]
        head = (BOS, SEP) if self.task == "copy" else (BOS,)
        answer = list(symbols) if self.task == "copy" else symbols[::-1]
        return Prompt(index, (PAD,) * self.prefix_padding + (*head, *symbols, SEP), answer=answer,
                      max_new_tokens=len(symbols), id=self.string_id(symbols))

    def reward(self, episode: Episode) -> float:
        return _score(episode.model_turns[-1], episode.prompt.answer)


class CopyText(ReverseText):
    """Copy the string: prompt ``BOS SEP s1..sK SEP``, answer ``s1..sK`` (same vocabulary and
    arguments as reverse-text; the SEP after BOS tells the two tasks apart in a mix)."""

    task = "copy"


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
