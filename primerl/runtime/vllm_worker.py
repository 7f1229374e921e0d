"""Worker extension loaded into vLLM workers (``--worker-extension-cls``) for weight updates.

vLLM mixes this class into each GPU worker, so ``self.model_runner`` and ``self.device`` are the
worker's. Called through ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``). Importing this
module does not need vLLM; the methods only run inside a vLLM worker.

- ``update_weights_from_path(path)``: read ``<path>/model.safetensors`` (Hugging Face names;
  FP8 experts may come with ``*_scale_inv``) and hand them to the model's ``load_weights``.
- ``init_broadcast(host, port, rank, world_size)`` then ``update_weights_from_broadcast(specs)``:
  join a process group with trainer rank 0 (rank 0 = trainer, workers after it) and receive
  every tensor of ``specs`` (``[(name, dtype, shape), ...]``) by broadcast from rank 0.
"""

from __future__ import annotations

from pathlib import Path


class WeightUpdateExtension:
    def update_weights_from_path(self, path: str) -> int:
        from safetensors.torch import load_file

        d = Path(path)
        if not (d / "STABLE").exists():
            raise FileNotFoundError(f"{d} has no STABLE marker: the weights are not completely written")
        weights = load_file(str(d / "model.safetensors"), device=str(self.device))
        self.model_runner.model.load_weights(weights=list(weights.items()))
        return int((d / "STABLE").read_text())

    def init_broadcast(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        import torch.distributed as dist

        rank = rank_offset + (dist.get_rank() if dist.is_initialized() else 0)
        self._primerl_group = new_group(host, port, rank, world_size)

    def update_weights_from_broadcast(self, specs: list) -> None:
        self.model_runner.model.load_weights(weights=receive_weights(self._primerl_group, specs, self.device))


def new_group(host: str, port: int, rank: int, world_size: int):
    """A process group outside vLLM's own (its own TCPStore rendezvous; rank 0 = the trainer)."""
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0))
    if torch.cuda.is_available():
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size)


def _broadcast(group, t) -> None:
    import torch
    import torch.distributed as dist

    if t.is_floating_point() and t.element_size() == 1:  # gloo has no fp8 types: move the bytes
        t = t.view(torch.uint8)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([t], opts).wait()


def weight_specs(state_dict) -> list:
    return [(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state_dict.items()]


def send_weights(group, state_dict) -> None:
    """Trainer side (rank 0): broadcast every tensor in ``weight_specs`` order."""
    for _, v in state_dict.items():
        _broadcast(group, v.detach().contiguous())


def receive_weights(group, specs: list, device="cpu") -> list:
    import torch

    out = []
    for name, dtype, shape in specs:
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        _broadcast(group, t)
        out.append((name, t))
    return out
