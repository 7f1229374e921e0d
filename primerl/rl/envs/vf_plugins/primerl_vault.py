"""A multi-turn tool-use task as a verifiers 0.4.0 taskset with an MCP toolset.

The user asks for the secret of a short key (``What is the secret of abc?``); the secret is only
available from the ``lookup`` tool (a ``@vf.tool`` method of ``VaultToolset``, served over MCP in
its own process, shared by every rollout). A solving episode takes two model turns: a tool call
``lookup(key="abc")``, then the answer after the tool's reply. Rewards (``@vf.reward``, summed by
weight): ``answer`` = similarity of the final reply to the secret (``difflib`` ratio, 1 when
exact), ``looked_up`` (weight 0.25) = 1 when the tool was called with the task's key.

    taskset id: primerl-vault
    knobs:      num_tasks, min_length, max_length, alphabet, seed  ([env.args.env.taskset])

``VaultTask.demonstration()`` is the solving conversation (``primerl.runtime.trainer.vf_warmstart`` trains
a random-init policy on a few hundred of them, so that RL starts from a policy that calls tools).
"""

from __future__ import annotations

import difflib
import json
import random

import verifiers.v1 as vf


def secret_of(key: str) -> str:
    """The vault's secret for ``key`` (what ``lookup`` returns): the key reversed."""
    return key[::-1]


class VaultToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the model sees the tool as plain `lookup`

    @vf.tool
    async def lookup(self, key: str) -> str:
        """Return the secret stored under key."""
        return secret_of(key)


class VaultData(vf.TaskData):
    key: str


class VaultConfig(vf.TasksetConfig):
    num_tasks: int = 1000
    min_length: int = 3
    max_length: int = 3
    alphabet: str = "abcd"
    seed: int = 0


class VaultTask(vf.Task[VaultData]):
    @vf.reward
    async def answer(self, trace) -> float:
        return difflib.SequenceMatcher(None, trace.last_reply, secret_of(self.data.key), autojunk=False).ratio()

    @vf.reward(weight=0.25)
    async def looked_up(self, trace) -> float:
        for msg in trace.assistant_messages:
            for call in msg.tool_calls or []:
                try:
                    args = json.loads(call.arguments or "{}")
                except json.JSONDecodeError:
                    continue
                if call.name == "lookup" and isinstance(args, dict) and args.get("key") == self.data.key:
                    return 1.0
        return 0.0

    @vf.metric
    async def solved(self, trace) -> float:
        return float(trace.last_reply == secret_of(self.data.key))

    def demonstration(self) -> list[dict]:
        """The solving conversation, as chat messages (after the task's prompt)."""
        key = self.data.key
        call = {"id": "call_0", "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"key": key})}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": secret_of(key)},
                {"role": "assistant", "content": secret_of(key)}]


class VaultTaskset(vf.Taskset[VaultTask, VaultConfig]):
    def load(self):
        c = self.config
        if not 1 <= c.min_length <= c.max_length or not c.alphabet:
            raise ValueError(f"vault: need 1 <= min_length <= max_length and an alphabet, got {c}")
        rng = random.Random(c.seed)
        for i in range(c.num_tasks):
            key = "".join(rng.choice(c.alphabet) for _ in range(rng.randint(c.min_length, c.max_length)))
            yield VaultTask(VaultData(id=str(i), prompt=f"What is the secret of {key}?", key=key), self.config.task)

    @classmethod
    def toolsets(cls, config):
        return [VaultToolset(vf.SharedToolsetConfig())]


__all__ = ["VaultTaskset"]

if __name__ == "__main__":  # the tool server process (verifiers runs `python -m <module>`)
    VaultToolset.run()
