"""``primerl eval --config X --checkpoint PATH``: the config's ``[[eval.env]]`` environments on a
saved checkpoint, on their own (no trainer), through the config's inference client.

The checkpoint (``<output_dir>/checkpoints/step_N``: the trainer's sharded DCP folder, whose model
part is read into the config's policy, or a full-state one's ``model.safetensors``) is loaded into
the client as policy version N; each eval environment runs exactly as the online evaluation does
(``evaluation.OnlineEval``: same prompts, seeds, sampling and metrics). With a verifiers eval
environment (``[[eval.env]]`` naming a verifiers training entry, or ``id = "verifiers"``) they run
as on the verifiers path (``vf_eval.LoopEval``): the engine is served over HTTP in this process
(``server.EngineServer``, port 0) for the command's duration, verifiers' episodes run on it with
the eval's sampling and the built-in eval environments' turns are generate requests to it. The
metrics are printed and written to ``<checkpoint>/eval.json``. The embedded backend only (a vLLM
server loads weights from the trainer's transport, not from a checkpoint folder).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from ..config import ConfigError


class CheckpointWeights:
    """The one 'version' a checkpoint holds, in the shape the clients' ``update_weights`` reads."""

    def __init__(self, cfg, path: Path, vocab_size: int):
        self.cfg, self.path, self.vocab_size = cfg, path, vocab_size

    def load_weights(self, version: int) -> dict:
        from ..trainer.dcp_checkpoint import is_dcp_checkpoint

        if not is_dcp_checkpoint(self.path):
            from safetensors.torch import load_file

            return load_file(str(self.path / "model.safetensors"))
        import torch.distributed.checkpoint as dcp

        from ..policy import build_model

        model = build_model(self.cfg, self.vocab_size)
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(self.path), no_dist=True)  # the model part only
        return state["model"]


def checkpoint_step(path: Path) -> int:
    meta = path / "meta.json"
    if meta.is_file():
        return int(json.loads(meta.read_text())["step"])
    return int(path.name.rpartition("_")[2]) if path.name.startswith("step_") else 0


def evaluate_checkpoint(cfg, checkpoint: str | Path) -> dict:
    """-> the eval metrics of ``checkpoint`` (``eval/<name>/pass@k``, ``/reward``, ``/version``)."""
    from ..config import eval_env_spec, load_policy_env
    from ..inference.backend import get_backend
    from ..trainer.dcp_checkpoint import is_dcp_checkpoint

    path = Path(checkpoint)
    if not (is_dcp_checkpoint(path) or (path / "model.safetensors").is_file()):
        raise ConfigError(f"--checkpoint: {path} is not a complete checkpoint (a step_N folder of "
                          "<output_dir>/checkpoints)")
    if not cfg.eval.env:
        raise ConfigError("eval.env: the config has no [[eval.env]] to evaluate")
    if cfg.inference.backend != "embedded":
        raise ConfigError(f"inference.backend: primerl eval runs the embedded engine only, got "
                          f"{cfg.inference.backend!r}")
    on_server = any(eval_env_spec(cfg, x)[0] == "verifiers" for x in cfg.eval.env)
    if on_server and cfg.inference.pd.enabled:
        raise ConfigError("inference.pd: primerl eval runs a verifiers eval environment on the engine in its own "
                          "process, not on P/D servers")
    env = load_policy_env(cfg)
    client = get_backend(cfg).make_client(cfg, env.vocab_size)
    step = checkpoint_step(path)
    client.update_weights(step, CheckpointWeights(cfg, path, env.vocab_size))
    out = {"step": step, **(_evaluate_on_server if on_server else _evaluate_through_client)(cfg, client, step)}
    (path / "eval.json").write_text(json.dumps(out, indent=1))
    return out


def _evaluate_through_client(cfg, client, step: int) -> dict:
    """Built-in eval environments only: their requests submitted to ``client`` directly."""
    from .evaluation import OnlineEval

    ev = OnlineEval(cfg)
    ev.interval = ev.interval or 1
    episodes, ids = {}, itertools.count(1)

    def submit(st, max_new, temperature, top_p, seed, stops):
        rid = next(ids)
        episodes[rid] = st
        client.submit(st.request(rid, seed, max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                                 stop_token_ids=stops))

    ev.start(step, submit)
    while ev.runs:
        for c in client.poll():
            ev.on_completion(episodes.pop(c.request_id), c)
        for st, name, ok, value in ev.poll():
            ev.on_env_result(st, name, ok, value, submit)
    return ev.pop_ready()


def _evaluate_on_server(cfg, client, step: int) -> dict:
    """With a verifiers eval environment: the verifiers path's evaluation (``vf_eval.LoopEval``, every
    eval environment) on the embedded engine served over HTTP in this process while it runs."""
    import asyncio

    from ..inference.backend import get_backend
    from .vf_eval import LoopEval

    ev = LoopEval(cfg)
    model = ev.own_envs()[0].model_name
    server, _ = get_backend(cfg).generate_server(cfg, client, policy_version=lambda: step, model_name=model)
    server.start()
    try:
        return asyncio.run(ev.run_once(server, step, model))
    finally:
        server.stop()


__all__ = ["evaluate_checkpoint"]
