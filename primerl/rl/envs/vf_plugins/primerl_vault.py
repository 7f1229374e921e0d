"""A multi-turn tool-use task as a verifiers 0.4.0 taskset with an MCP toolset and its own ``vf.Env``.

The user asks for the secret of a short key (``What is the secret of cafe?``). The secret is a
hash of the key (``secret_of``): nothing in the prompt predicts it, and only the ``lookup`` tool
returns it (a ``@vf.tool`` method of ``VaultToolset``, served over MCP in its own process, shared
by every rollout). ``VaultEnv`` runs each episode as an exchange (``agent.interaction``): after
every harness segment whose final reply is not the secret it answers as the user
(``Not the secret of <key>. Use the lookup tool.``) and the exchange goes on, until the reply is
the secret or the agent's ``max_turns`` ends it. So an episode is at least two model turns unless
the first reply guesses the secret (chance ``1 / len(SECRET_ALPHABET) ** len(key)``): a solving
episode is the tool call, then the answer after the tool's reply. Rewards (``@vf.reward``, summed
by weight): ``answer`` = similarity of the final reply to the secret (``difflib`` ratio, 1 when
exact), ``looked_up`` (weight 0.25) = 1 when the tool was called with the task's key.

    taskset id: primerl-vault
    knobs:      num_tasks, min_length, max_length, alphabet, seed  ([env.args.env.taskset])
    env knobs:  feedback  ([env.args.env]; the user's reply to a wrong answer, ``{key}`` filled in)

``VaultTask.demonstration()`` is the solving conversation: ``[warm_start]`` in a job's config
(``primerl.runtime.trainer.vf_warmstart``) trains a random-init policy on a few hundred of them
before RL, so that RL starts from a policy that writes tool calls.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import random

import verifiers.v1 as vf

SECRET_ALPHABET = "abcdefgh"


def secret_of(key: str) -> str:
    """The vault's secret for ``key`` (what ``lookup`` returns): as many letters of
    ``SECRET_ALPHABET`` as the key has, drawn from the SHA-256 of the key."""
    digest = hashlib.sha256(f"primerl-vault:{key}".encode()).digest()
    return "".join(SECRET_ALPHABET[b % len(SECRET_ALPHABET)] for b in digest[:len(key)])


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
    min_length: int = 4
    max_length: int = 4
    alphabet: str = "abcdefgh"
    seed: int = 0


class VaultTask(vf.Task[VaultData]):
    def solved_by(self, reply: str) -> bool:
        return reply.strip() == secret_of(self.data.key)

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
        return float(self.solved_by(trace.last_reply))

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


class VaultEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    """The one seat (the policy); its ``max_turns`` caps the model turns of an episode."""
    feedback: str = "Not the secret of {key}. Use the lookup tool."
    """The user's reply to a segment whose final answer is not the secret (``{key}``: the task's key)."""


class VaultEnv(vf.Env[VaultEnvConfig]):
    """One agent in an exchange with a user who checks its answer: a wrong final reply gets
    ``feedback`` and the agent goes on; the exchange ends on the secret or at ``max_turns``."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            while not segment.terminated and not task.solved_by(segment.last_reply):
                segment = await chat.turn(self.config.feedback.replace("{key}", task.data.key))


__all__ = ["VaultTaskset", "VaultEnv"]

if __name__ == "__main__":  # the tool server process (verifiers runs `python -m <module>`)
    VaultToolset.run()
