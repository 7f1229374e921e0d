"""verifiers 0.4.0 environments in primerl: the environment side of the verifiers path.

A verifiers environment (``vf.Env`` over a ``vf.Taskset``) runs its own episodes: its harness talks
to the model through verifiers' train client, which renders each prompt to token ids with a
``renderers`` renderer and samples on the job's inference server
(``POST /inference/v1/generate``); the finished ``vf.Trace`` holds, per branch, the token ids, the
sampled mask, the sampling log-probs and the routed experts, and ``trace.reward`` is the weighted
sum of the task's ``@vf.reward`` methods. So primerl does not drive the turns here
(``prompt``/``respond``/``reward`` are not used); the orchestrator's verifiers path
(``primerl.runtime.orchestrator.vf_orchestrator``) runs the episodes and ``branch_sample`` turns each trainable
branch into a training sample, token-exactly.

Configured as an environment (``verifiers`` is imported only when one is built)::

    [env]
    id = "verifiers"
    [env.args]
    tokenizer = "builtin:qwen3-tiny"    # or a local Hugging Face tokenizer directory
    renderer = "qwen3"                  # a renderers config name; renderer_args = {enable_thinking = false}
    max_tokens = 24                     # per model turn
    max_concurrent = 64                 # episodes in flight; episode_timeout_s = 600 each
    heldout_fraction = 0.1              # tasks held out by a hash of their prompt (split = "heldout": only those)
    [env.args.env]                      # verifiers' own env config (vf.resolve_env_config)
    taskset = { id = "primerl-reverse-text" }
    agent = { harness = { id = "primerl-inprocess" }, runtime = { type = "subprocess" }, max_turns = 1 }

``plugin_paths``: folders of the user's own tasksets / harnesses, ADDED in front of this package's
``vf_plugins`` folder (the example tasksets and the ``primerl-inprocess`` harness, always there);
all are put on ``sys.path`` and ``PYTHONPATH``: verifiers loads tasksets and harnesses by top-level
module name, as installed environment packages are. A module of a user folder shadows one of the
same name in ``vf_plugins``. ``pip install 'primerl[verifiers]'``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import zlib
from pathlib import Path

from .base import Environment

PLUGIN_DIR = Path(__file__).resolve().parent / "vf_plugins"
BUILTIN_TOKENIZER = "builtin:qwen3-tiny"


def _need_verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ImportError("the verifiers environment needs verifiers 0.4.0: pip install 'primerl[verifiers]' "
                          "(docs/verifiers.md)") from None
    return vf


def builtin_tokenizer_dir() -> str:
    """The ``builtin:qwen3-tiny`` tokenizer, built once under ``$PRIMERL_CACHE`` (default
    ``~/.cache/primerl``) in a folder named by the builder's source hash."""
    from . import vf_tokenizer as t

    digest = hashlib.sha256(Path(t.__file__).read_bytes()).hexdigest()[:12]
    root = Path(os.environ.get("PRIMERL_CACHE", Path.home() / ".cache" / "primerl"))
    path = root / f"qwen3-tiny-{digest}"
    if not (path / "tokenizer_config.json").exists():
        tmp = root / f".tmp-{digest}-{os.getpid()}"
        t.build_qwen3_tokenizer(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process built it meanwhile
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def plugin_dirs(plugin_paths: list[str] | None) -> list[str]:
    """``env.args.plugin_paths`` -> the folders to load from: the user's (checked to exist), then
    ``vf_plugins``, each once."""
    if plugin_paths is None:
        plugin_paths = []
    if isinstance(plugin_paths, (str, Path)) or not all(isinstance(p, (str, Path)) for p in plugin_paths):
        raise ValueError(f"verifiers env: env.args.plugin_paths must be a list of folders, got {plugin_paths!r}")
    out = []
    for p in [*plugin_paths, PLUGIN_DIR]:
        d = Path(p).expanduser().resolve()
        if not d.is_dir():
            raise ValueError(f"verifiers env: env.args.plugin_paths: {p} is not a folder")
        if str(d) not in out:
            out.append(str(d))
    return out


def add_plugin_paths(paths: list[str]) -> None:
    """Put ``paths`` first on ``sys.path`` and on ``PYTHONPATH`` (verifiers starts tool servers as
    ``python -m <module>`` subprocesses, which must find the same modules)."""
    paths = [str(Path(p).resolve()) for p in paths]
    for p in paths[::-1]:
        if p not in sys.path:
            sys.path.insert(0, p)
    env = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([p for p in paths if p not in env] + env)


class VerifiersEnv(Environment):
    """A verifiers environment, its tokenizer and renderer, and the sampling of its model turns.

    ``vocab_size`` is the tokenizer's size (the policy must cover it); ``max_new_tokens`` the cap
    per model turn. ``vf_env`` (built on first use) is the ``vf.Env``; ``tasks`` its taskset's
    tasks (a finite taskset, or the first ``num_tasks`` of an infinite one)."""

    max_turns = 0  # turns are the harness's (the agent's max_turns), not the orchestrator's

    def __init__(self, env: dict, tokenizer: str = BUILTIN_TOKENIZER, *, renderer: str = "qwen3",
                 renderer_args: dict | None = None, max_tokens: int = 64, sampling: dict | None = None,
                 model_name: str = "primerl", max_concurrent: int = 64, num_tasks: int | None = None,
                 plugin_paths: list[str] | None = None, episode_timeout_s: float = 600.0, split: str = "train",
                 heldout_fraction: float = 0.0):
        if not isinstance(env, dict) or not env.get("taskset"):
            raise ValueError("verifiers env: env.args.env must be verifiers' env config with a taskset "
                             "(e.g. {taskset = {id = 'primerl-reverse-text'}})")
        if not episode_timeout_s > 0:
            raise ValueError(f"verifiers env: episode_timeout_s must be > 0, got {episode_timeout_s}")
        if max_tokens < 1 or max_concurrent < 1:
            raise ValueError(f"verifiers env: max_tokens and max_concurrent must be >= 1, "
                             f"got {max_tokens}, {max_concurrent}")
        if split not in ("train", "heldout"):
            raise ValueError(f"verifiers env: split must be 'train' or 'heldout', got {split!r}")
        if not 0.0 <= heldout_fraction < 1.0 or (split == "heldout" and heldout_fraction <= 0.0):
            raise ValueError(f"verifiers env: heldout_fraction must be in [0, 1) (> 0 for split = 'heldout'), "
                             f"got {heldout_fraction}")
        self.split, self.heldout_fraction = split, float(heldout_fraction)
        _need_verifiers()
        add_plugin_paths(plugin_dirs(plugin_paths))
        self.env_config = env
        self.tokenizer_path = builtin_tokenizer_dir() if tokenizer == BUILTIN_TOKENIZER else str(tokenizer)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        self.vocab_size = len(self.tokenizer)
        self.renderer_name, self.renderer_args = renderer, dict(renderer_args or {})
        self.max_new_tokens = int(max_tokens)
        self.sampling = dict(sampling or {})
        self.model_name, self.max_concurrent = model_name, int(max_concurrent)
        self.episode_timeout_s = float(episode_timeout_s)
        self._num_tasks = num_tasks
        self._vf_env = None
        self._tasks = None

    @property
    def vf_env(self):
        if self._vf_env is None:
            vf = _need_verifiers()
            self._vf_env = vf.load_environment(vf.resolve_env_config(dict(self.env_config)))
        return self._vf_env

    @property
    def tasks(self) -> list:
        if self._tasks is None:
            ts = self.vf_env.taskset
            if not ts.bounded and self._num_tasks is None:
                raise ValueError("verifiers env: the taskset is infinite; set env.args.num_tasks")
            tasks = ts.take(self._num_tasks) if self._num_tasks is not None else ts
            self._tasks = [t for t in tasks if self.heldout_fraction == 0.0
                           or self.is_heldout(t) == (self.split == "heldout")]
            if not self._tasks:
                raise ValueError(f"verifiers env: the taskset yielded no task (of split {self.split!r})")
        return self._tasks

    def is_heldout(self, task) -> bool:
        """Whether ``task`` lies in the held-out part (``heldout_fraction``) of the taskset: by a hash
        of its prompt text (its key when it has none), so tasks with the same prompt share a split."""
        text = task.data.prompt_text if task.data.prompt is not None else ""
        h = zlib.crc32((text or f"key:{task.key}").encode()) / 2**32
        return h < self.heldout_fraction

    @property
    def num_prompts(self) -> int:
        return len(self.tasks)

    def prompts(self) -> list[str]:
        """The taskset's task keys (verifiers' ``Task.key``: a content hash unless the taskset names
        its tasks), in task order: task ``i`` of a batch is prompt id ``prompts()[i]``."""
        return [str(t.key) for t in self.tasks]

    def renderer_config(self):
        from renderers import RendererConfig
        from pydantic import TypeAdapter

        return TypeAdapter(RendererConfig).validate_python({"name": self.renderer_name, **self.renderer_args})

    def model_context(self, base_url: str, *, temperature: float, top_p: float, model: str | None = None,
                      sampling: dict | None = None):
        """verifiers' ``ModelContext``: the train client on ``base_url`` (the inference server's
        root), this env's renderer and tokenizer, and the job's sampling (``args.sampling`` laid
        over it, and ``sampling`` over both: an online eval's); ``model``: the served model name
        (default ``model_name``)."""
        vf = _need_verifiers()
        client = vf.TrainClientConfig(base_url=base_url.rstrip("/") + "/v1", api_key_var="PRIMERL_INFERENCE_API_KEY",
                                      renderer=self.renderer_config(), renderer_model_name=self.tokenizer_path)
        sampling = vf.Sampling(**{"temperature": temperature, "top_p": top_p, "max_tokens": self.max_new_tokens,
                                  **self.sampling, **(sampling or {})})
        return vf.ModelContext(model=model or self.model_name, client=client, sampling=sampling)

    def prompt(self, index: int):
        raise NotImplementedError("a verifiers environment runs its own episodes: the orchestrator's verifiers path "
                                  "(primerl.runtime.orchestrator.vf_orchestrator) drives it, not prompt()/reward()")

    def reward(self, episode):
        raise NotImplementedError("a verifiers environment is scored by its tasks' @vf.reward methods")


# ---------------------------------------------------------------------------------- trace -> sample
class BranchError(ValueError):
    """A branch that cannot become a sample; the message is the reason (counted, episode resampled)."""


def branch_sample(branch, *, advantage: float, temperature: float, replay: bool, vocab_size: int):
    """One trainable ``vf.Branch`` -> ``primerl.rl.packing.Sample``: ``input_ids`` = the branch's
    token ids (every node: prompt scaffold, model turns, tool/env turns), ``loss_mask`` = its
    sampled mask (the model's own tokens only), ``inference_logprobs`` = the sampling log-probs
    on those tokens (0 elsewhere), ``replay_ids`` = its routed experts ``[T, L, k]`` when
    ``replay``."""
    import torch

    from primerl.rl.packing import Sample

    ids = branch.token_ids
    mask = branch.sampled_mask
    if not ids or len(mask) != len(ids):
        raise BranchError(f"branch {branch.index}: {len(ids)} token ids but {len(mask)} mask entries")
    if not any(mask):
        raise BranchError(f"branch {branch.index}: no sampled token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BranchError(f"branch {branch.index}: token ids {bad[:5]} outside the policy's vocabulary "
                          f"[0, {vocab_size})")
    per_node = [(len(n.logprobs), sum(n.mask)) for n in branch.nodes if any(n.mask)]
    if any(a != b for a, b in per_node):
        raise BranchError(f"branch {branch.index}: a model turn has log-probs for {per_node} (count, sampled) tokens")
    logprobs = branch.logprobs
    routing = None
    if replay:
        re = branch.routed_experts
        if re is None:
            raise BranchError(f"branch {branch.index}: router replay is on but the branch has no routed experts")
        routing_dtype = torch.uint8 if re.max(initial=0) < 256 else torch.int32
        routing = torch.from_numpy(re.astype("int64", copy=False)).to(routing_dtype)
        if routing.shape[0] != len(ids):
            raise BranchError(f"branch {branch.index}: routed experts for {routing.shape[0]} of {len(ids)} tokens")
    return Sample(input_ids=torch.tensor(ids, dtype=torch.long), loss_mask=torch.tensor(mask, dtype=torch.bool),
                  advantages=float(advantage), inference_logprobs=torch.tensor(logprobs, dtype=torch.float32),
                  temperature=temperature, replay_ids=routing)


def sampled_spans(mask: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` of True in ``mask``."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def check_branch_against_requests(branch, requests: list[tuple[list[int], list[int], list[float]]]) -> None:
    """Token-exactness: each model turn of ``branch`` (a run of sampled tokens ``[a, b)``) must be a
    completion the inference server returned, for the prompt ``token_ids[:a]``, with the same
    log-probs. ``requests``: the server's record of the session, ``(prompt, completion, logprobs)``."""
    ids, lps = branch.token_ids, branch.logprobs
    by_prompt = {}
    for prompt, completion, logprobs in requests:
        by_prompt.setdefault(len(prompt), []).append((prompt, completion, logprobs))
    for a, b in sampled_spans(branch.sampled_mask):
        hit = [r for r in by_prompt.get(a, []) if r[0] == ids[:a] and r[1] == ids[a:b]]
        if not hit:
            raise BranchError(f"branch {branch.index}: the model turn at tokens {a}..{b} is not what the inference "
                              "server sampled for that prompt (re-tokenized or edited)")
        if not any(max((abs(x - y) for x, y in zip(r[2], lps[a:b])), default=0.0) <= 1e-6 for r in hit):
            raise BranchError(f"branch {branch.index}: the log-probs of the model turn at tokens {a}..{b} differ "
                              "from the sampler's")


def trace_reward(trace) -> float:
    """``trace.reward`` after checking that every declared reward ran (a ``None`` entry: scoring
    did not run). Raises BranchError naming the missing reward."""
    if not trace.rewards:
        raise BranchError("the trace has no reward (the task declares no @vf.reward, or scoring did not run)")
    missing = [k for k, v in trace.rewards.items() if v is None]
    if missing:
        raise BranchError(f"reward(s) {missing} did not run")
    return float(trace.reward)


__all__ = ["VerifiersEnv", "BranchError", "branch_sample", "check_branch_against_requests", "sampled_spans",
           "trace_reward", "builtin_tokenizer_dir", "PLUGIN_DIR", "BUILTIN_TOKENIZER"]
