"""An in-process chat harness for verifiers: the model/tool loop runs in the orchestrator's event
loop instead of as a ``uv``-run program.

verifiers' ``null`` / ``bash`` harnesses write a PEP 723 script and run it with ``uv``, which
resolves the script's dependencies from the package index at run time (``uv sync --script``);
a job must not fetch anything mid-run, so this harness plays the same part in process. As the
``Harness.launch`` contract allows, every model call still goes to the rollout's interception
endpoint with its secret (so the trace records each turn, token-exactly, through the train
client); tools are the task's MCP servers (``@vf.tool`` methods of a ``vf.Toolset``), called
over MCP as the script would. The loop: send the conversation with the tool schemas; append the
reply; if it has tool calls, run each and append the results as ``tool`` messages; repeat until
a reply without tool calls, or until the agent's ``max_turns`` / a ``@vf.stop`` ends the trace
(the interception refuses the next call).

Harness id: ``primerl-inprocess`` (``[env.agent.harness] id = "primerl-inprocess"``; this folder is put on
``sys.path`` by ``primerl.rl.envs.verifiers_env``, as an installed environment package would be).
Needs verifiers (``pip install 'primerl[verifiers]'``).
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack

import httpx

import verifiers.v1 as vf
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp


class InProcessHarnessConfig(vf.HarnessConfig):
    tool_error_feedback: bool = True
    """A malformed tool call (bad JSON, unknown tool) is answered with an error message as its
    result (the model sees it and the episode goes on), instead of ending the episode."""
    connect_timeout_s: float = 300.0
    """Seconds to connect to the rollout's interception endpoint. It is served on the orchestrator's
    event loop, which a loaded CPU keeps busy for seconds at a time; the OpenAI client's default of
    5 s then fails episodes (``APITimeoutError``). Reads are not bounded here: the episode's timeout
    (``env.args.episode_timeout_s``) is the backstop."""


class InProcessChatHarness(vf.Harness[InProcessHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        from openai import AsyncOpenAI, APIStatusError

        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            from verifiers.v1.dialects.chat import message_to_wire

            messages.extend(message_to_wire(m) for m in prompt)
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0,
                             timeout=httpx.Timeout(None, connect=self.config.connect_timeout_s))
        try:
            async with AsyncExitStack() as stack:
                if mcp_urls:
                    config = {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                                             for name, url in mcp_urls.items()}}
                    tools, dispatch, servers = await connect_mcp(config, stack)
                else:
                    tools, dispatch, servers = [], {}, {}
                while True:
                    try:
                        completion = await client.chat.completions.create(
                            model=ctx.model, messages=messages, **({"tools": tools} if tools else {}))
                    except APIStatusError:
                        if trace.stop_condition is not None:  # a limit or @vf.stop refused the next turn
                            break
                        raise
                    message = completion.choices[0].message
                    messages.append(message.model_dump(exclude_none=True))
                    if not message.tool_calls:
                        break
                    for call in message.tool_calls:
                        messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                         "content": await self._run_tool(call, dispatch, servers)})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    async def _run_tool(self, call, dispatch, servers) -> str:
        name = call.function.name
        try:
            args = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError as e:
            if not self.config.tool_error_feedback:
                raise
            return f"error: the arguments are not valid JSON ({e})"
        if not isinstance(args, dict) or name not in dispatch:
            if not self.config.tool_error_feedback:
                raise ValueError(f"bad tool call {name!r} with {args!r}")
            return f"error: unknown tool {name!r}" if name not in dispatch else "error: arguments must be a JSON object"
        out = await call_mcp(servers, dispatch, name, args)
        return out if isinstance(out, str) else json.dumps(out)


__all__ = ["InProcessChatHarness"]
