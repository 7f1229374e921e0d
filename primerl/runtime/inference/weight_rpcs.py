"""The engine server's weight control plane, as vLLM's server and primerl's worker extension
(``vllm_worker``) answer it, so ``VLLMClient`` / the trainer's weight channels drive both the same way:

- ``POST /collective_rpc`` ``{"method", "args"}``: ``update_weights_from_path(dir)`` (a published
  ``model.safetensors``, primerl's names or the Hugging Face layout; the version from ``STABLE``),
  ``init_broadcast(host, port, rank_offset, world_size[, timeout_s[, prefix]])`` then
  ``update_weights_from_broadcast()`` (trainer rank 0 sends over torch.distributed,
  ``weight_broadcast``), ``init_weight_transfer(host, port[, timeout_s[, prefix]])`` then
  ``update_weights_from_transfer()`` (the bucketed transfer of ``weight_transfer`` over a group of
  this server and trainer rank 0: a pool's weights, ``pool_broadcast``), ``weights_version``; each
  answers ``{"results": [one per worker]}``;
- ``POST /pause`` / ``POST /resume`` / ``GET /is_paused``: stop stepping the engine (requests and
  their KV cache kept) and continue.

Every load runs on the engine thread between two steps (``EngineThread.call``).
"""

from __future__ import annotations

from pathlib import Path

from .engine_thread import EngineThread, Pending

def _own_names(model, sd: dict) -> dict:
    """Weights in primerl's names: vLLM reads the Hugging Face layout (what the trainer publishes for
    ``inference.backend = vllm``); primerl's own names are accepted too."""
    if "model.embed_tokens.weight" not in sd:
        return sd
    from .hf_weights import primerl_weights

    return primerl_weights(model, sd)


class WeightRPCs:
    """Pause / resume, weight loads (from a path or a broadcast) and the version, on ``engine_thread``'s engine."""

    def __init__(self, engine_thread: EngineThread, request_timeout: float):
        self.engine_thread = engine_thread
        self.request_timeout = request_timeout
        self._broadcast = None  # weight_broadcast.BroadcastReceiver once trainer rank 0 asked (init_broadcast)
        self._transfer = None  # weight_receive.PairReceiver once trainer rank 0 asked (init_weight_transfer)

    @property
    def engine(self):
        return self.engine_thread.engine

    def version(self) -> int:
        """The policy version the engine's weights are."""
        return self.engine.policy_version

    def is_paused(self) -> bool:
        return self.engine_thread.paused

    def start_pause(self) -> Pending:
        """``POST /pause``: stop stepping the engine (after the step under way), keeping every
        request and its KV cache."""
        return Pending(self.engine_thread.set_paused(True), lambda _: {"status": "paused"})

    def start_resume(self) -> Pending:
        """``POST /resume``: continue stepping."""
        return Pending(self.engine_thread.set_paused(False), lambda _: {"status": "resumed"})

    def collective_rpc(self, body: dict) -> tuple[int, dict] | Pending:
        """``POST /collective_rpc``: the method by name. ValueError for an unknown one."""
        method = body.get("method")
        if method == "weights_version":  # as vLLM's worker extension: one answer per worker
            return 200, {"results": [{"version": self.version()}]}
        if method in ("init_broadcast", "update_weights_from_broadcast"):
            return self.start_broadcast_call(body["method"], body.get("args", []))
        if method in ("init_weight_transfer", "update_weights_from_transfer"):
            return self.start_transfer_call(body["method"], body.get("args", []))
        if method != "update_weights_from_path":
            raise ValueError(f"collective_rpc: unknown method {method!r}")
        return self.start_update_weights(*body.get("args", []))

    def start_update_weights(self, path: str) -> Pending:
        """Load ``path``/model.safetensors as version ``path``/STABLE (default: the current + 1)."""
        from primerl.models.checkpoint import read_safetensors

        from ..transport import wait_republished

        d = Path(path)
        wait_republished(d)  # a version being republished: its directory is back within moments
        sd = read_safetensors(d / "model.safetensors")
        version = int((d / "STABLE").read_text()) if (d / "STABLE").exists() else self.engine.policy_version + 1

        def load():
            self.engine.load_weights(_own_names(self.engine.model, sd), version)

        return Pending(self.engine_thread.call(load), lambda _: {"results": [{"version": version}]})

    def start_broadcast_call(self, method: str, args: list) -> Pending:
        """``init_broadcast(host, port, rank_offset, world_size[, timeout_s[, prefix]])`` then
        ``update_weights_from_broadcast()``, as vLLM's worker extension (``vllm_worker``) answers
        them: trainer rank 0 sends the weights over a torch.distributed group (gloo, NCCL on a GPU),
        no file. The join and each receive run on a thread of their own (never the HTTP loop's or
        the engine's); the load runs on the engine thread between steps."""
        from .weight_broadcast import BroadcastReceiver

        if method == "init_broadcast":
            if not 4 <= len(args) <= 6:
                raise ValueError("init_broadcast takes (host, port, rank_offset, world_size[, timeout_s[, prefix]]), "
                                 f"got {args!r}")
            self._broadcast = BroadcastReceiver(self.engine.device, *args)
            return Pending(self._broadcast.join(), lambda _: {"results": [None]})
        if self._broadcast is None:
            raise ValueError("update_weights_from_broadcast before init_broadcast")

        def load(version, weights):
            own = _own_names(self.engine.model, dict(weights))
            self.engine_thread.call_and_wait(lambda: self.engine.load_weights(own, version), self.request_timeout)

        return Pending(self._broadcast.receive(load), lambda version: {"results": [{"version": version}]})

    def start_transfer_call(self, method: str, args: list) -> Pending:
        """``init_weight_transfer(host, port[, timeout_s[, prefix]])`` then ``update_weights_from_transfer()``:
        the bucketed transfer (``weight_transfer``: buckets, FP8 in transit, deltas) over a two-rank
        group of this server with trainer rank 0 (``pool_broadcast``); the load runs on the engine
        thread between steps, as for ``update_weights_from_broadcast``."""
        from .weight_receive import PairReceiver

        if method == "init_weight_transfer":
            if not 2 <= len(args) <= 4:
                raise ValueError(f"init_weight_transfer takes (host, port[, timeout_s[, prefix]]), got {args!r}")
            self._transfer = PairReceiver(self.engine.device, *args)
            return Pending(self._transfer.join(), lambda _: {"results": [None]})
        if self._transfer is None:
            raise ValueError("update_weights_from_transfer before init_weight_transfer")

        def load(version, weights):  # fresh tensors, assembled for this version: swapped in, not copied
            own = _own_names(self.engine.model, dict(weights))
            self.engine_thread.call_and_wait(lambda: self.engine.load_weights(own, version, assign=True),
                                             self.request_timeout)

        return Pending(self._transfer.receive(load), lambda version: {"results": [{"version": version}]})


__all__ = ["WeightRPCs"]
