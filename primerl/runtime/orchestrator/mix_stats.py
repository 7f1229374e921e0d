"""What both orchestrators (built-in environments, and the verifiers path with its mix) report and
decide per finished group the same way: dynamic sampling's keep-or-replace, the per-environment
metrics of a mix, the curriculum's records and its saved state.

A finished group is described by ``Outcome`` (its environment's index in the mix, its prompt id,
its rewards, its sampled tokens), so the two loops' own group types never meet here.
"""

from __future__ import annotations

from typing import NamedTuple


class Outcome(NamedTuple):
    env: int  # index in the job's mix (sampling.MixEnv)
    key: str  # the prompt's id (the curriculum's key)
    rewards: list  # one per episode (the verifiers path: per trainable trace)
    tokens: int  # sampled tokens


class MixStats:
    """``mix``: the job's ``sampling.MixEnv``s; ``sampler``: its ``sampling.PromptSampler``."""

    def __init__(self, cfg, mix, sampler):
        self.cfg, self.o, self.mix, self.sampler = cfg, cfg.orchestrator, mix, sampler
        self._mix_counts = [0] * len(mix)  # groups trained per environment (the observed mix)
        self._filtered_rewards: dict[int, list[float]] = {}  # step -> rewards of the groups dapo dropped

    def replaces(self, step: int, g: Outcome, counters: dict) -> bool:
        """``orchestrator.filter = "dapo"``: True when finished group ``g`` of batch ``step`` is to be
        replaced by a fresh prompt's group (its rewards are all equal and the batch has sampled fewer
        than ``max_oversample x batch_size`` groups: ``counters["groups_sampled"]``); its rewards then
        count in ``reward/all_sampled`` and in the curriculum. A uniform group past the budget is
        kept (``counters["groups_uniform_kept"]``). The caller counts ``groups_filtered``."""
        if self.o.filter != "dapo" or any(r != g.rewards[0] for r in g.rewards):
            return False
        if counters["groups_sampled"] >= self.o.max_oversample * self.o.batch_size:
            counters["groups_uniform_kept"] += 1
            return False
        cur = self.sampler.curriculum
        if cur is not None:  # what was learnt about the dropped prompt still counts
            cur.record(step, self.mix[g.env].name, g.key, g.rewards)
        self._filtered_rewards.setdefault(step, []).extend(g.rewards)
        return True

    def metrics(self, step: int, groups: list[Outcome], counters: dict) -> dict:
        """Per environment (a mix), dynamic sampling's counts, the curriculum's; records the batch's
        groups for the curriculum and saves its state where the trainer will checkpoint."""
        out = {}
        if len(self.mix) > 1:
            for g in groups:
                self._mix_counts[g.env] += 1
            total = max(sum(self._mix_counts), 1)
            for e, m in enumerate(self.mix):
                mine = [g for g in groups if g.env == e]
                rewards = [r for g in mine for r in g.rewards]
                out[f"groups/{m.name}"] = len(mine)
                out[f"episodes/{m.name}"] = len(rewards)
                out[f"tokens/{m.name}"] = sum(g.tokens for g in mine)
                if rewards:
                    out[f"reward/{m.name}"] = sum(rewards) / len(rewards)
                out[f"mix/{m.name}"] = self._mix_counts[e] / total
        if self.o.filter == "dapo":
            # reward/mean is the kept groups' (uniform ones left out); reward/all_sampled every group sampled
            dropped = self._filtered_rewards.pop(step, [])
            kept = [r for g in groups for r in g.rewards]
            out.update({"groups/filtered": counters["groups_filtered"],
                        "rollouts/oversampled": counters["rollouts_oversampled"],
                        "groups/uniform_kept": counters["groups_uniform_kept"],
                        "reward/all_sampled": (sum(kept) + sum(dropped)) / (len(kept) + len(dropped))})
        cur = self.sampler.curriculum
        if cur is not None:
            for g in groups:
                cur.record(step, self.mix[g.env].name, g.key, g.rewards)
            out.update(cur.metrics())
            ck = self.cfg.checkpoint
            if (ck.interval and (step + 1) % ck.interval == 0) or step + 1 == self.cfg.max_steps:
                self.sampler.save_state(self.cfg.output_dir, step + 1, keep=ck.keep + 1)
        return out


__all__ = ["MixStats", "Outcome"]
