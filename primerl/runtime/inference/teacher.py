"""The distillation teacher: where its model comes from, and its log-probs of given tokens.

``resolve_teacher(path)`` reads what ``distill.teacher`` names without loading weights (for
``--dry-run``): a primerl run directory (its ``config.toml`` and the latest checkpoint under
``checkpoints/``), one checkpoint of a run (``<run>/checkpoints/step_N``: the run's config two
levels up) or a Hugging Face directory (``config.json`` + safetensors). ``load_teacher`` builds the
model with the teacher's own config (any size or family the runtime loads) and its weights.

``score_logprobs(model, sequences)`` is the prefill-only scoring every teacher route shares (the
orchestrator's in-process teacher and ``POST /v1/score`` of ``primerl inference``): one forward
over the packed sequences (on the CPU the trainer's padded attention path, ``padded_forward``:
the attention kernel walks a packed batch sequence by sequence); entry t of a sequence's result
is ``log softmax(logits_{t-1} / T)`` at token t (entry 0 has no prediction: 0.0 here, ``null`` on the wire, as vLLM's
``prompt_logprobs``). ``score_topk`` adds the k most likely tokens of every position's distribution
(``distill.topk``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TeacherSource", "resolve_teacher", "load_teacher", "score_logprobs", "score_topk", "check_same_vocabulary"]


@dataclass
class TeacherSource:
    path: Path
    kind: str  # "hf" or "primerl"
    model_config: object  # primerl.models.MoETransformerConfig
    run_config: object | None = None  # the primerl run's RLConfig (kind "primerl")
    checkpoint: Path | None = None  # kind "primerl": the checkpoint directory loaded


def resolve_teacher(path: str, key: str = "distill.teacher") -> TeacherSource:
    """What ``path`` holds (no weights read); ``ConfigError`` naming ``key`` when it is none of the three."""
    from primerl.models.config import MoETransformerConfig

    from ..config import ConfigError, load_config, load_policy_env
    from ..policy import model_config
    from ..trainer.checkpoint import latest_checkpoint

    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{key}: {path!r} is not a directory (a primerl run or checkpoint, or a Hugging Face "
                          "directory)")
    if (p / "config.json").exists():
        try:
            return TeacherSource(p, "hf", MoETransformerConfig.from_hf(p))
        except Exception as e:  # noqa: BLE001 - any unreadable config is refused naming the key
            raise ConfigError(f"{key}: {path!r}: its config.json cannot be loaded: {e}") from None
    if (p / "meta.json").exists() and (p.parent.parent / "config.toml").exists():
        run, ckpt = p.parent.parent, p
    elif (p / "config.toml").exists():
        found = latest_checkpoint(p / "checkpoints")
        if found is None:
            raise ConfigError(f"{key}: the primerl run {path!r} has no checkpoint under checkpoints/ (did it finish?)")
        run, ckpt = p, found[1]
    else:
        raise ConfigError(f"{key}: {path!r} is neither a primerl run (config.toml + checkpoints/), a checkpoint "
                          "(<run>/checkpoints/step_N) nor a Hugging Face directory (config.json)")
    try:
        run_cfg = load_config(run / "config.toml", check=False)
        mc = model_config(run_cfg, load_policy_env(run_cfg).vocab_size)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{key}: the config of the primerl run {str(run)!r} cannot be used: {e}") from None
    return TeacherSource(p, "primerl", mc, run_cfg, ckpt)


def check_same_vocabulary(src: TeacherSource, cfg, student_vocab: int, key: str = "distill.teacher") -> None:
    """The teacher must share the student's tokenizer: the same vocabulary size and, for a primerl
    run (whose tokens are its environment's), the same environment and arguments; for Hugging Face
    directories with tokenizer files on both sides, the same files. ``ConfigError`` naming ``key``."""
    from ..config import ConfigError

    tv = src.model_config.vocab_size
    if tv != student_vocab:
        raise ConfigError(f"{key}: the teacher's vocabulary ({tv} tokens, {src.path}) differs from the student's "
                          f"({student_vocab}): distillation needs the same tokenizer")
    if src.kind == "primerl":
        t_env = (src.run_config.env.id, dict(src.run_config.env.args))
        s_env = (cfg.env.id, dict(cfg.env.args))
        if t_env != s_env:
            raise ConfigError(f"{key}: the teacher was trained on env {t_env[0]!r} {t_env[1]} and the student samples "
                              f"env {s_env[0]!r} {s_env[1]}: their token vocabularies differ")
    elif cfg.model.path:
        for name in ("tokenizer.json", "vocab.json", "tokenizer.model"):
            a, b = src.path / name, Path(cfg.model.path) / name
            if a.exists() and b.exists() and a.read_bytes() != b.read_bytes():
                raise ConfigError(f"{key}: the teacher's {name} differs from the student's (model.path): "
                                  "distillation needs the same tokenizer")


def load_teacher(src: TeacherSource, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
    """The teacher's ``MoETransformer`` (eval, no grad) with its weights, on ``device``."""
    from primerl.models.transformer import MoETransformer
    from primerl.rl.envs import load_environment

    from ..policy import build_model

    if src.kind == "hf":
        model = MoETransformer.from_pretrained(str(src.path), dtype=dtype)
    else:
        env = load_environment(src.run_config.env.id, **src.run_config.env.args)
        model = build_model(src.run_config, env.vocab_size, dtype=torch.float32)
        _load_checkpoint_weights(model, src.checkpoint)
        model = model.to(dtype=dtype)
    model = model.to(device).eval()
    model.requires_grad_(False)
    return model


def _load_checkpoint_weights(model, ckpt: Path) -> None:
    from ..trainer.checkpoint import load_checkpoint
    from ..trainer.dcp_checkpoint import is_dcp_checkpoint

    if is_dcp_checkpoint(ckpt):
        import warnings

        import torch.distributed.checkpoint as dcp

        state = {"model": model.state_dict()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
        model.load_state_dict(state["model"])
    else:
        _, sd, _ = load_checkpoint(ckpt)
        model.load_state_dict(sd)


def score_logprobs(model, sequences: list[list[int]], *, temperature: float = 1.0,
                   max_tokens: int = 16384) -> list[list[float]]:
    """Per-token log-probs of ``sequences`` under ``model`` (prefill only; forwards of at most
    ``max_tokens`` packed tokens, a longer sequence alone): ``out[i][t] = log p(seq_i[t] | seq_i[:t])``
    at ``temperature``, ``out[i][0] = 0.0``."""
    return [lp for lp, _, _ in _score(model, sequences, temperature, max_tokens, 0)]


def score_topk(model, sequences: list[list[int]], k: int, *, temperature: float = 1.0,
               max_tokens: int = 16384) -> list[tuple[list[float], list[list[int]], list[list[float]]]]:
    """``score_logprobs`` and, per position, the model's ``k`` most likely tokens and their
    log-probs: ``out[i] = (logprobs [L], topk_ids [L][k], topk_logprobs [L][k])``, entry t the
    distribution token t was drawn from (entry 0: ids 0 and log-probs 0.0, no prediction); ties
    in the order ``torch.topk`` gives."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"score_topk: k must be an integer >= 1, got {k!r}")
    return _score(model, sequences, temperature, max_tokens, k)


@torch.no_grad()
def _score(model, sequences, temperature, max_tokens, k):
    dev = next(model.parameters()).device
    out: list = [None for _ in sequences]
    chunk: list[int] = []
    n = 0

    def run(idx: list[int]) -> None:
        seqs = [sequences[i] for i in idx]
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=dev)
        pos = torch.cat([torch.arange(len(s)) for s in seqs]).to(dev)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor([len(s) for s in seqs]).cumsum(0)
        if dev.type == "cpu":  # many short sequences: one padded SDPA per layer (the trainer's CPU path)
            from ..trainer.padded_attention import padded_forward

            logits = model.lm_head(padded_forward(model, ids, pos, cu)).float()
        else:
            logits = model(ids, pos, cu.to(dev), return_logits=True).float()
        lp = torch.log_softmax(logits / temperature, dim=-1)
        # the prediction at t-1 scores token t: gather the next token of every position
        nxt = torch.roll(ids, -1, 0)
        scored = lp.gather(1, nxt.unsqueeze(1)).squeeze(1).cpu()
        top = lp.topk(k, dim=-1) if k else None
        top_lp, top_ids = (top.values.cpu(), top.indices.cpu()) if k else (None, None)
        for i, a, b in zip(idx, cu[:-1].tolist(), cu[1:].tolist()):
            row = [0.0] + scored[a:b - 1].tolist()
            if k:
                out[i] = (row, [[0] * k] + top_ids[a:b - 1].tolist(), [[0.0] * k] + top_lp[a:b - 1].tolist())
            else:
                out[i] = (row, None, None)

    for i, s in enumerate(sequences):
        if chunk and n + len(s) > max_tokens:
            run(chunk)
            chunk, n = [], 0
        chunk.append(i)
        n += len(s)
    if chunk:
        run(chunk)
    return out
