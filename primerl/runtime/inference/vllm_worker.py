"""Worker extension loaded into vLLM workers (``--worker-extension-cls``) for weight updates.

vLLM mixes this class into each worker (GPU or CPU), so ``self.model_runner`` and ``self.device``
are the worker's. Called through ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``). Importing
this module does not need vLLM; the methods only run inside a vLLM worker.

- ``update_weights_from_path(path)``: read ``<path>/model.safetensors`` (Hugging Face names;
  FP8 experts may come with ``*_scale_inv``) and load them; returns the version in the marker.
- ``init_broadcast(host, port, rank, world_size)`` then ``update_weights_from_broadcast()``:
  join a process group with trainer rank 0 (rank 0 = trainer, workers after it) and receive one
  update by broadcast from rank 0 (``weight_broadcast.send_update`` / ``receive_update``: a header
  with the version and the tensor specs, then every tensor); returns the version. With ``specs``
  (``[(name, dtype, shape), ...]``) only the tensors are received (no header).
- ``weights_version()``: the version the worker holds; ``-1`` after an update that failed part
  way (the model may hold a mix of two versions and must not be sampled from); ``None`` before
  the first update (the weights the server was started with).

Loading goes through vLLM's in-place reload (``vllm.model_executor.model_loader.reload``): after
the first load vLLM post-processes layers into kernel formats (on CPU the linear weights are
repacked and ``layer.weight`` is left empty, without a ``weight_loader``), so the layers are first
restored to their checkpoint format, loaded, then post-processed again into the same storage.
An update must carry every tensor of the checkpoint the server started from (else it is refused
before anything is loaded) and must write every parameter of the model (else it raises and the
version becomes ``-1``).
"""

from __future__ import annotations

from pathlib import Path

from .weight_broadcast import new_group, receive_update, receive_weights

__all__ = ["WeightUpdateExtension", "checkpoint_tensor_names", "load_in_place"]


class WeightUpdateExtension:
    _primerl_version: int | None = None
    _primerl_checkpoint_names: set | None = None  # tensor names of the checkpoint the server started from

    def weights_version(self) -> int | None:
        return self._primerl_version

    def update_weights_from_path(self, path: str) -> int:
        from safetensors.torch import load_file

        from primerl.runtime.transport import wait_republished

        d = Path(path)
        if not wait_republished(d):
            raise FileNotFoundError(f"{d} has no STABLE marker: the weights are not completely written")
        version = int((d / "STABLE").read_text())
        weights = load_file(str(d / "model.safetensors"), device=str(self.device))
        return self._primerl_load(version, list(weights.items()))

    def init_broadcast(self, host: str, port: int, rank_offset: int, world_size: int,
                       timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        rank = rank_offset + (dist.get_rank() if dist.is_initialized() else 0)
        self._primerl_group = new_group(host, port, rank, world_size, timeout_s=timeout_s)

    def update_weights_from_broadcast(self, specs: list | None = None) -> int | None:
        if specs is not None:
            return self._primerl_load(None, receive_weights(self._primerl_group, specs, self.device))
        version, weights = receive_update(self._primerl_group, self.device)
        return self._primerl_load(version, weights)

    def _primerl_load(self, version: int | None, weights: list) -> int | None:
        runner = self.model_runner
        vllm_config = getattr(runner, "vllm_config", None)
        if vllm_config is not None:  # (None: a test double without vLLM)
            if self._primerl_checkpoint_names is None:
                self._primerl_checkpoint_names = checkpoint_tensor_names(vllm_config.model_config)
            missing = sorted(self._primerl_checkpoint_names - {name for name, _ in weights})
            if missing:  # refused before loading anything: the served weights stay as they were
                raise ValueError(f"weight update (version {version}) lacks {len(missing)} tensors of the served "
                                 f"checkpoint (e.g. {missing[:5]}); nothing was loaded")
        self._primerl_version = -1  # until every parameter is written: a failure leaves mixed weights
        missing = load_in_place(runner.model, vllm_config, weights)
        if missing:
            raise RuntimeError(f"weight update left {len(missing)} parameters unwritten (e.g. {missing[:5]}); "
                               "the update is incomplete")
        self._primerl_version = version
        return version


def checkpoint_tensor_names(model_config) -> set[str]:
    """Tensor names in the safetensors files of the checkpoint vLLM serves (a local directory, or the
    Hugging Face cache entry it was loaded from), FP8 ``*_scale_inv`` scales left out. A fused MoE
    parameter is written by many checkpoint tensors, so a missing one cannot be seen from the
    parameters written: updates are checked against these names instead."""
    from safetensors import safe_open

    d = Path(model_config.model)
    if not d.is_dir():
        from huggingface_hub import snapshot_download

        d = Path(snapshot_download(model_config.model, revision=model_config.revision, local_files_only=True,
                                   allow_patterns=["*.safetensors"]))
    names: set[str] = set()
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            names.update(sf.keys())
    if not names:
        raise FileNotFoundError(f"no safetensors files in {d}: cannot check weight updates for completeness")
    return {n for n in names if not n.endswith("_scale_inv")}


def load_in_place(model, vllm_config, weights: list) -> list[str]:
    """Load ``[(hf_name, tensor), ...]`` into a vLLM model that already ran its post-load processing;
    returns the model's parameters that the update did not write (empty when complete).

    Uses vLLM's layerwise reload where the installed vLLM has it (restore checkpoint-format layers,
    load, re-process into the original kernel storage); a plain ``load_weights`` otherwise."""
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:  # older vLLM (parameters keep their loaders after processing), or a test double
        loaded = model.load_weights(weights=weights)
        expected = {n for n, _ in model.named_parameters()} if hasattr(model, "named_parameters") else set()
        return sorted(expected - set(loaded or expected))
    cpu = _on_cpu()
    initialize_layerwise_reload(model)
    expected = {name for name, _ in model.named_parameters()}  # the checkpoint-format parameters
    try:
        loaded = model.load_weights(weights=weights)
    finally:
        finalize_layerwise_reload(model, vllm_config.model_config)
    if cpu:  # (after a failed load the version stays -1: nothing to repair)
        _prepack_cpu_experts(model)
    return sorted(expected - set(loaded))


_CPU_RELOAD_VERIFIED = "0.32."


def _on_cpu() -> bool:
    """Whether vLLM runs on CPU; a CPU build other than the verified one is refused (before loading):
    :func:`_prepack_cpu_experts` repairs a 0.32 behaviour, and prepacking twice would scramble the
    weights of a build that no longer needs it."""
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    if not vllm.__version__.startswith(_CPU_RELOAD_VERIFIED):
        raise RuntimeError(f"weight updates on a vLLM CPU build are verified with vLLM {_CPU_RELOAD_VERIFIED}x only "
                           f"(MoE prepack after reload), this is {vllm.__version__}; nothing was loaded")
    return True


def _prepack_cpu_experts(model) -> None:
    """vLLM 0.32's unquantized MoE method runs its experts' own post-load hook only on the first load
    (``_setup_kernel`` skips it when the kernel exists); on CPU that hook prepacks ``w13``/``w2``
    into the grouped-GEMM layout, so after a reload the CPU kernel would read unpacked weights
    (measured: MoE outputs off by ~1e-2 after reloading the very same weights). Run it again."""
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None:
            experts.process_weights_after_loading(layer)
