"""File transport between orchestrator, trainer and inference: rollout batches and weights.

Layout under ``root``::

    rollouts/step_000012/rank_0.pt       micro-batches for trainer rank 0 at step 12
    weights/step_000012/model.safetensors  policy after 12 optimizer steps
    weights/step_000012/STABLE            marker: the directory is complete
    weights/step_000012/config.json       with the Hugging Face layout (inference.backend = vllm)

Every file is written to a temporary name in the same directory and renamed into place
(``os.replace`` is atomic on POSIX), so a reader never sees a partial file; weights are
published by renaming a complete temporary directory, marker included, into place; a version
published again (a resumed trainer's start version) replaces the old directory whole.
Every wait takes a timeout and an optional ``alive()`` probe of the producer, so a dead
producer is reported instead of waited on forever.
"""

from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # torch is loaded where tensors are read or written: the launcher never does
    import torch

STABLE = "STABLE"

# Set by ``primerl node`` from the node plan (launch.node.peer_env); unset on one machine.
# the orchestrator's node: its receiver hosts the weight group's store
ENGINE_HOST_ENV = "PRIMERL_ENGINE_BROADCAST_HOST"
ORCHESTRATOR_NODE_ENV = "PRIMERL_ORCHESTRATOR_NODE"  # "the orchestrator on node 2 (10.0.0.7)", for the trainer's errors
TRAINER_NODE_ENV = "PRIMERL_TRAINER_NODE"  # "the trainer on node 0 (10.0.0.5)", for the orchestrator's errors
# JSON {"servers": [url, ...], "router": url, "processes": path} of the job's server pool, set by
# the launcher (one machine) or ``primerl node`` (from the plan) for the orchestrator and the trainer
INFERENCE_POOL_ENV = "PRIMERL_INFERENCE_POOL"
# this trainer node's address (``primerl node``): rank 0 hosts its weight groups there
TRAINER_HOST_ENV = "PRIMERL_TRAINER_HOST"


class TransportTimeout(TimeoutError):
    pass


class ProducerDied(RuntimeError):
    pass


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


REPLACE_WAIT_S = 30.0  # load_weights: the longest wait for a version being republished
TMP_PREFIX = ".tmp_step_"  # a checkpoint being written: <root>/.tmp_step_<step>.<writer pid>


def _replaced_name(version: str, pid: int | str) -> str:
    """The old copy of weights version ``version`` (6 digits) while ``publish_weights`` replaces it."""
    return f"{TMP_PREFIX}{version}.replaced.{pid}"


def wait_republished(d: str | Path, timeout: float | None = None) -> bool:
    """Whether the published weights directory ``d`` (``.../weights/step_<version>``) has its
    marker, waiting up to ``timeout`` s (default ``REPLACE_WAIT_S``) while the version is being
    republished: between the two renames of ``FileTransport.publish_weights`` replacing it, the
    directory is briefly absent and its old copy sits beside it as ``.tmp_step_<version>.replaced.<pid>``."""
    d = Path(d)
    deadline = time.monotonic() + (REPLACE_WAIT_S if timeout is None else timeout)
    while not (d / STABLE).exists() and any(d.parent.glob(_replaced_name(d.name.removeprefix("step_"), "*"))) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    return (d / STABLE).exists()


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def remove_stale_tmp_dirs(root: str | Path) -> list[Path]:
    """Delete the temp directories of checkpoint writes that can no longer finish: those of a
    process that is gone, or of this process (called at start, and after a failed save). Returns
    what was removed. A failed save (ENOSPC, a crash) would otherwise leave them forever, filling
    the disk and making the next save fail too. Any checkpoint writer names its temp directory
    ``TMP_PREFIX + <anything>.<pid>`` so this finds it."""
    from .lifetime import pid_alive

    removed = []
    for d in Path(root).glob(TMP_PREFIX + "*"):
        pid = d.name.rpartition(".")[2]
        if pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid)):
            continue  # another live writer's save in progress
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
        else:
            d.unlink(missing_ok=True)
        removed.append(d)
    return removed


def wait_for(predicate: Callable[[], Any], *, timeout: float, what: str,
             alive: Callable[[], bool] | None = None, poll: float = 0.005, max_poll: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy; raise on timeout or a dead producer."""
    deadline = time.monotonic() + timeout
    while True:
        out = predicate()
        if out:
            return out
        if alive is not None and not alive():
            raise ProducerDied(f"gave up waiting for {what}: its producer is no longer running")
        if time.monotonic() > deadline:
            raise TransportTimeout(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)
        poll = min(poll * 1.5, max_poll)


class FileTransport:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.rollouts = self.root / "rollouts"
        self.weights = self.root / "weights"
        self.rollouts.mkdir(parents=True, exist_ok=True)
        self.weights.mkdir(parents=True, exist_ok=True)

    # ---- rollout batches (orchestrator -> trainer) ----
    def batch_path(self, step: int, rank: int) -> Path:
        return self.rollouts / f"step_{step:06d}" / f"rank_{rank}.pt"

    def put_batch(self, step: int, rank: int, payload: Any) -> Path:
        path = self.batch_path(step, rank)
        atomic_torch_save(payload, path)
        return path

    def get_batch(self, step: int, rank: int, *, timeout: float, alive: Callable[[], bool] | None = None) -> Any:
        path = self.batch_path(step, rank)
        wait_for(path.exists, timeout=timeout, what=f"rollout batch of step {step} (rank {rank}) at {path}",
                 alive=alive)
        import torch

        return torch.load(path, weights_only=False)

    def wait_taken(self, timeout: float) -> None:
        """Batches written are on disk: nothing to wait for (``ZmqTransport`` waits for receipts)."""

    def close(self) -> None:
        """Files hold no connection (``ZmqTransport`` closes its sockets)."""

    def drop_batches_before(self, step: int) -> None:
        for d in self.rollouts.glob("step_*"):
            if int(d.name[5:]) < step:
                shutil.rmtree(d, ignore_errors=True)

    def drop_batches_from(self, step: int) -> None:
        """Used on resume: batches produced for steps a previous run never finished are stale."""
        for d in self.rollouts.glob("step_*"):
            if int(d.name[5:]) >= step:
                shutil.rmtree(d, ignore_errors=True)

    # ---- weights (trainer -> inference) ----
    def weights_dir(self, version: int) -> Path:
        return self.weights / f"step_{version:06d}"

    def publish_weights(self, version: int, state_dict: dict[str, torch.Tensor] | None,
                        *, config: dict | None = None, write: Callable[[Path], None] | None = None) -> Path:
        """Write ``model.safetensors`` (and ``config.json`` when given), then the marker.
        ``state_dict=None`` publishes the marker alone: the weights went another way (broadcast).
        ``write(path)``, instead of ``state_dict``: writes ``model.safetensors`` itself (streamed)."""
        import json

        from safetensors.torch import save_file

        final = self.weights_dir(version)
        tmp = self.weights / f"{TMP_PREFIX}{version:06d}.{os.getpid()}"
        old = self.weights / _replaced_name(f"{version:06d}", os.getpid())
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            if write is not None:
                write(tmp / "model.safetensors")
            elif state_dict is not None:
                tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
                save_file(tensors, str(tmp / "model.safetensors"), metadata={"version": str(version)})
            if config is not None:
                (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            atomic_write_bytes(tmp / STABLE, str(version).encode())
            # a republished version (a resumed trainer publishes its start version again) is never
            # changed in place, where a reader may be loading it: the old directory is renamed
            # away whole, the new one renamed in, and only then is the old one deleted
            replaced = final.exists()
            if replaced:
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            if replaced:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            if old.exists() and not final.exists():  # failed between the two renames: the old copy stays published
                os.replace(old, final)
            remove_stale_tmp_dirs(self.weights)
            raise
        return final

    def weight_versions(self) -> list[int]:
        """The published versions (their ``STABLE`` marker exists), oldest first. Which versions
        inference can load is the backend's ``WeightVersions`` (``weight_sync``), which reads these
        markers when the weights come as files."""
        return sorted(int(d.name[5:]) for d in self.weights.glob("step_*") if (d / STABLE).exists())

    def latest_weights(self) -> int | None:
        versions = self.weight_versions()
        return versions[-1] if versions else None

    def wait_weights(self, min_version: int, *, timeout: float, alive: Callable[[], bool] | None = None) -> int:
        def ready():
            v = self.latest_weights()
            return (v,) if v is not None and v >= min_version else None

        return wait_for(ready, timeout=timeout, what=f"policy weights of version >= {min_version}", alive=alive)[0]

    def load_weights(self, version: int) -> dict[str, torch.Tensor]:
        from primerl.models.checkpoint import read_safetensors

        d = self.weights_dir(version)
        if not wait_republished(d):
            raise FileNotFoundError(f"weights of version {version} are not published at {d}")
        if not (d / "model.safetensors").exists():
            if (d / "adapter_model.safetensors").exists():  # trainer.lora: the version is a PEFT adapter directory
                return read_safetensors(d / "adapter_model.safetensors")
            raise FileNotFoundError(f"version {version} at {d} is a marker only (its weights were broadcast)")
        return read_safetensors(d / "model.safetensors")

    def drop_weights_before(self, version: int) -> None:
        for d in self.weights.glob("step_*"):
            if int(d.name[5:]) < version:
                shutil.rmtree(d, ignore_errors=True)

    def drop_weights_after(self, version: int) -> None:
        for d in self.weights.glob("step_*"):
            if int(d.name[5:]) > version:
                shutil.rmtree(d, ignore_errors=True)
