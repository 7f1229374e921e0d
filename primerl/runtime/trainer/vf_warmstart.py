"""Supervised warm start for a verifiers environment: a random-init policy learns the task's
format from its demonstrations before RL.

A random-init policy never writes a well-formed tool call (``<tool_call>`` + JSON naming a tool), so
a tool-use task gives it no multi-turn episode to learn from. Tasks that define
``demonstration() -> list[messages]`` (the assistant/tool messages that solve them, e.g.
``primerl_vault``) are turned into training sequences exactly as RL will see them: each assistant
turn's prompt is the renderer's generation prompt (the first turn) or its bridge from the
previous turn (later turns; ``renderer.bridge_to_next_turn``, what verifiers' train client
sends), the completion is the assistant message's token ids ending with the stop token, and the
cross-entropy is on the completion tokens only. The tool schemas are the ones the harness offers
(read from one real episode's trace). The result is written as a Hugging Face model directory,
``<output_dir>/warm_start`` when the job's config asks for it (``[warm_start] steps = N``): ``primerl rl``
runs it before RL (``job_warm_start``) and RL starts from it. Standalone, into any directory::

    python -m primerl.runtime.trainer.vf_warmstart --config <config.toml> --out <dir> --steps 60
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import shutil
import time
from pathlib import Path

log = logging.getLogger("primerl.warmstart")


def _tool_specs(env, cfg) -> list[dict] | None:
    """The tools the harness offers, as chat-template tool specs, read off one real episode."""
    from verifiers.v1.clients.train import tool_to_wire

    from ..inference.engine import InferenceEngine
    from ..policy import build_model
    from ..inference.server import EngineServer

    srv = EngineServer(InferenceEngine(build_model(cfg, env.vocab_size), max_batch_size=4, capture_routing=False),
                       model_name=env.model_name).start()
    try:
        ctx = env.model_context(srv.url, temperature=1.0, top_p=1.0)

        async def one():
            async with env.vf_env.serving():
                return await env.vf_env.run_episode(env.tasks[0], ctx)

        ep = asyncio.run(one())
    finally:
        srv.stop()
    if not ep.traces:
        raise RuntimeError(f"warm start: the probe episode ran no agent: {ep.errors}")
    tools = ep.traces[0].tools
    return [tool_to_wire(t) for t in tools] or None


def demonstration_tokens(renderer, tokenizer, task, tools) -> tuple[list[int], list[bool]]:
    """(token ids, loss mask) of one demonstration, turn by turn as the train client renders it."""
    data = task.data
    messages = ([{"role": "system", "content": data.system_prompt}] if data.system_prompt else [])
    messages += [{"role": "user", "content": data.prompt}] if isinstance(data.prompt, str) else list(data.prompt)
    demo = task.demonstration()
    stop = renderer.get_stop_token_ids()[0]
    ids: list[int] = []
    mask: list[bool] = []
    tail: list[dict] = []
    prev_prompt: list[int] = []  # the previous assistant turn's prompt and completion (bridged from)
    prev_completion: list[int] = []
    for msg in demo:
        if msg["role"] != "assistant":
            tail.append(msg)
            continue
        if not ids:
            prompt = renderer.render(messages, tools=tools, add_generation_prompt=True).token_ids
        else:
            bridged = renderer.bridge_to_next_turn(prev_prompt, prev_completion, tail, tools=tools)
            if bridged is None:
                raise ValueError("warm start: the renderer cannot bridge this demonstration's turns")
            prompt = bridged.token_ids
        text = msg.get("content") or ""
        for call in msg.get("tool_calls") or []:
            f = call["function"]
            call_json = f'{{"name": "{f["name"]}", "arguments": {f["arguments"]}}}'
            text += ("\n" if text else "") + f"<tool_call>\n{call_json}\n</tool_call>"
        completion = tokenizer.encode(text, add_special_tokens=False) + [stop]
        parsed = renderer.parse_response(completion, prompt_ids=prompt, tools=tools)
        if msg.get("tool_calls") and len(parsed.tool_calls) != len(msg["tool_calls"]):
            raise ValueError(f"warm start: the renderer does not parse the demonstration's tool call back: {text!r}")
        if prompt[:len(ids)] != ids:
            raise ValueError("warm start: a bridged prompt does not extend the previous turn")
        mask += [False] * (len(prompt) - len(ids)) + [True] * len(completion)
        ids = prompt + completion
        prev_prompt, prev_completion, tail = prompt, completion, []
    return ids, mask


def warm_start(cfg, *, steps: int = 200, batch_size: int = 16, lr: float = 3e-3, out: str | None = None,
               seed: int = 0) -> dict:
    """Train ``cfg``'s random-init policy on the environment's demonstrations; save to ``out``
    (default ``cfg.model.path``). -> {"loss_first", "loss_last", "sequences", "seconds"}."""
    import torch
    import torch.nn.functional as F

    from ..config import load_policy_env, policy_env

    from ..policy import build_model

    out = out or cfg.model.path
    if not out:
        raise ValueError("warm start: give --out (or model.path): where the warm-started policy is written")
    init_cfg = copy.deepcopy(cfg)
    init_cfg.model.path = ""  # the random init the [model] fields describe
    env, env_id = load_policy_env(cfg), policy_env(cfg).id
    if not hasattr(env, "tasks") or not callable(getattr(env.tasks[0], "demonstration", None)):
        raise ValueError(f"warm start: environment {env_id!r} has no task demonstrations (Task.demonstration())")
    from renderers import create_renderer

    renderer = create_renderer(env.tokenizer, env.renderer_config())
    tools = _tool_specs(env, init_cfg)
    seqs = [demonstration_tokens(renderer, env.tokenizer, t, tools) for t in env.tasks]
    model = build_model(init_cfg, env.vocab_size).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    losses = []
    for step in range(steps):
        pick = torch.randint(len(seqs), (batch_size,), generator=g).tolist()
        ids = torch.tensor([t for i in pick for t in seqs[i][0]])
        mask = torch.tensor([m for i in pick for m in seqs[i][1]])
        lens = [len(seqs[i][0]) for i in pick]
        pos = torch.cat([torch.arange(n) for n in lens])
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        logits = model(ids, pos, cu, return_logits=True)
        # token t is predicted from position t-1; a sequence's first token never is
        target_mask = mask.clone()
        target_mask[cu[:-1].long()] = False
        prev = torch.nonzero(target_mask).squeeze(1)
        loss = F.cross_entropy(logits[prev - 1].float(), ids[prev])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            log.info("warm start step %d/%d: loss %.4f", step, steps, losses[-1])
    model.eval()
    Path(out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return {"loss_first": losses[0], "loss_last": losses[-1], "sequences": len(seqs),
            "seconds": time.perf_counter() - t0}


WARM_START_DIR = "warm_start"


def job_warm_start(cfg, *, quiet: bool = True):
    """``cfg`` itself without ``[warm_start]``; else a copy whose ``model.path`` is the warm-started
    policy, trained now into ``<output_dir>/warm_start`` (or, when resuming, the one a previous run of
    the same config left there) and whose ``warm_start.steps`` is 0 (the copy is what the job's
    processes read: they start from that policy). Runs in the launcher, before any job process."""
    w = cfg.warm_start
    if not w.steps:
        return cfg
    from dataclasses import asdict

    out = Path(cfg.output_dir) / WARM_START_DIR
    stamp = {"model": asdict(cfg.model), "warm_start": asdict(w), "env": asdict(cfg.env), "seed": cfg.seed}
    record = out / "warm_start.json"
    reuse = False
    if cfg.checkpoint.resume and record.exists():
        try:
            reuse = json.loads(record.read_text()).get("config") == json.loads(json.dumps(stamp, default=str))
        except (OSError, ValueError):
            reuse = False
    if reuse:
        log.info("warm start: reusing %s (same config)", out)
        if not quiet:
            print(f"primerl rl: warm start reused from {out} (resuming, same config)", flush=True)
    else:
        shutil.rmtree(out, ignore_errors=True)
        if not quiet:
            print(f"primerl rl: warm start, {w.steps} supervised steps on the task demonstrations -> {out}", flush=True)
        import torch  # (here: the launcher calls this for every job, and loads torch only to train)

        threads = torch.get_num_threads()
        torch.set_num_threads(cfg.threads)
        try:
            r = warm_start(cfg, steps=w.steps, batch_size=w.batch_size, lr=w.lr, out=str(out), seed=cfg.seed)
        finally:
            torch.set_num_threads(threads)
        record.write_text(json.dumps({"config": stamp, "result": r}, indent=1, default=str))
        msg = (f"warm start: {r['sequences']} demonstrations, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f} "
               f"in {r['seconds']:.0f} s")
        log.info(msg)
        if not quiet:
            print(f"primerl rl: {msg}", flush=True)
    resolved = copy.deepcopy(cfg)
    resolved.model.path = str(out)
    resolved.warm_start.steps = 0
    return resolved


def _model_path(config: str, overrides: list[str]) -> str:
    """``model.path`` of the config file, or of a ``--model.path`` override."""
    import tomllib

    for i, a in enumerate(overrides):
        if a == "--model.path" and i + 1 < len(overrides):
            return overrides[i + 1]
        if a.startswith("--model.path="):
            return a.split("=", 1)[1]
    with open(config, "rb") as f:
        return tomllib.load(f).get("model", {}).get("path", "")


def main(argv: list[str] | None = None) -> int:
    import torch

    # the config's own checks (fields, names, trainer layout), not the job's: the warm start runs here,
    # on the CPU, with none of the job's processes, nodes or devices
    from ..config import load_config

    p = argparse.ArgumentParser(prog="python -m primerl.runtime.trainer.vf_warmstart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default=None, help="default: the config's model.path")
    args, rest = p.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s warmstart %(levelname)s %(message)s")
    out = args.out or _model_path(args.config, rest)
    # model.path does not exist yet (this writes it): load the config with the random init
    cfg = load_config(args.config, [*rest, "--model.path", ""])
    torch.set_num_threads(cfg.threads)
    r = warm_start(cfg, steps=args.steps, batch_size=args.batch_size, lr=args.lr, out=out)
    print(f"warm start: {r['sequences']} demonstrations, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f} in "
          f"{r['seconds']:.0f} s; policy written to {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
