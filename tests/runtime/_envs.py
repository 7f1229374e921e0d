"""Environments for the job tests (imported by path inside the job's processes)."""

from primerl.rl.envs import ReverseText


class AlwaysRaises(ReverseText):
    def reward(self, episode):
        raise RuntimeError("grader crashed")


class FirstTokenWeighted(ReverseText):
    """Weight 3 on each completion's first token, 0 on the others (prompt tokens: any value)."""

    def token_weights(self, episode):
        n_prompt = len(episode.prompt.tokens)
        return [1.0] * n_prompt + [3.0] + [0.0] * (len(episode.tokens) - n_prompt - 1)


class NegativeWeights(ReverseText):
    def token_weights(self, episode):
        return [-1.0] * len(episode.tokens)
