"""Inference backends: what serves the orchestrator's requests, behind one interface.

``inference.backend`` names an :class:`InferenceBackend` in :data:`BACKENDS`; the built-ins
``embedded`` (``embedded_backend``: the engine in the orchestrator's process, ``primerl inference``
servers for a pool or P/D) and ``vllm`` (``vllm_backend``: vLLM's OpenAI server, launched or not)
register themselves. A backend

- declares its :class:`BackendCapabilities`; :func:`check_backend` refuses a config asking for one it
  lacks, naming the key (``primerl rl --dry-run`` fails in one line), then runs ``backend.check``;
- makes the orchestrator's client (``make_client``) and starts the servers of a job on this machine
  (``servers``, ``pd_commands``);
- chooses the trainer's ``WeightChannel`` (``weight_channel``) and the orchestrator's
  ``WeightVersions`` (``weight_receiver``);
- makes the distillation teacher's client (``make_teacher_client``: in-process, or its server);
- describes itself for ``--dry-run`` (``describe``, ``describe_placement``) and for the memory plan
  (``inference_plan``).

Nothing outside this module and the backends' own compares ``inference.backend`` to a name.

A backend of one's own is one module (``Extending the runtime`` in the docs)::

    from primerl.runtime.inference.backend import register_backend
    from primerl.runtime.inference.embedded_backend import EmbeddedBackend

    @register_backend("my-engine")
    class MyEngine(EmbeddedBackend):
        name = "my-engine"

then ``--inference.backend my-engine`` (the module imported first), ``--inference.backend
mypkg.mod:MyEngine``, or an entry point in the group ``primerl.inference_backends``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Protocol, runtime_checkable

from ..config import ConfigError
from ..registry import Registry

if TYPE_CHECKING:
    from ..config import RLConfig
    from ..transport import FileTransport
    from .weight_channels import WeightChannel, WeightVersions

__all__ = ["BACKENDS", "BackendCapabilities", "GenerateServer", "InferenceBackend", "InferenceClient",
           "check_backend", "get_backend", "register_backend"]


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can serve; :func:`check_backend` refuses the keys that ask for more."""

    pd: bool                 # inference.pd (prefill/decode servers)
    broadcast: bool          # weights by torch.distributed broadcast
    routed_experts: bool     # routed-expert capture for trainer.router_replay
    server_pool: bool        # inference.num_servers > 1 (servers started by primerl)
    external_servers: bool   # inference.vllm.urls
    launch: bool             # starts its own server (inference.vllm.launch)
    inference_nodes: bool    # serves on deployment.inference_nodes
    # the engine runs in the orchestrator's process on a device the placement picks
    # (inference.gpu_ids[0]); False: its servers run elsewhere, on the GPUs inference.gpu_ids reserves
    engine_in_process: bool = False
    # takes the bucketed transfer's FP8 / delta forms (inference.weight_transfer.dtype / delta)
    weight_transfer: bool = False


@runtime_checkable
class InferenceClient(Protocol):
    """The orchestrator's client, whatever the backend (``make_client`` returns one).

    ``submit(request)`` queues a ``engine.Request``; ``poll()`` returns the ``engine.Completion``s
    finished since the last call; ``update_weights(version, transport)`` makes inference hold
    ``version`` (raises when it cannot); ``metrics()`` adds the client's own per-step metrics to
    the batch (``{}`` when it has none: e.g. ``inference/redispatched`` of a pool,
    ``inference/pd_resampled`` of P/D, ``memory/engine_peak_gb`` of an engine on a GPU)."""

    def submit(self, req) -> None: ...

    def poll(self) -> list: ...

    def abort(self, request_ids) -> None: ...

    def has_pending(self) -> bool: ...

    def servers_healthy(self) -> int: ...

    def update_weights(self, version: int, transport: "FileTransport") -> None: ...

    def metrics(self) -> dict: ...


class GenerateServer(NamedTuple):
    """The verifiers path's HTTP route (``orchestrator.vf_orchestrator``): ``server`` serves
    ``/inference/v1/generate`` (``start()``, ``stop()``, ``url``, ``pop_session(id)``); ``engine`` is
    the in-process engine it drives (weights are loaded into it on the server's engine thread), or
    None when the backend's servers load their weights themselves (``client.update_weights``)."""

    server: Any
    engine: Any


class InferenceBackend(ABC):
    """One inference backend (one instance per name, registered in :data:`BACKENDS`)."""

    name: str
    capabilities: BackendCapabilities

    def check(self, cfg: "RLConfig") -> None:
        """This backend's own config checks (beyond its capabilities); ``ConfigError`` naming the key."""

    def check_machine(self, cfg: "RLConfig") -> None:
        """This backend's checks of ``cfg`` against this machine (``validate``'s machine part: skipped by
        ``primerl plan``); ``ConfigError`` naming the key."""

    @abstractmethod
    def describe(self, cfg: "RLConfig") -> str:
        """``--dry-run``: ``#`` comment lines saying which servers, router, roles and ports it starts."""

    @abstractmethod
    def describe_placement(self, cfg: "RLConfig", placement) -> str:
        """The ``# inference: ...`` line of ``placement.describe_placement`` (no newline)."""

    def beside_orchestrator(self, cfg: "RLConfig") -> str:
        """``--dry-run``'s node line: what runs on the orchestrator's node with it for this backend
        (its in-process engine, the servers and router it or the launcher starts there); "" for nothing."""
        return f"{self.name} engine" if self.capabilities.engine_in_process else ""

    @abstractmethod
    def make_client(self, cfg: "RLConfig", vocab_size: int, *, pool: dict | None = None) -> InferenceClient:
        """The orchestrator's client. ``pool``: ``launch.servers.ServerPool.endpoints()`` of the job's
        server pool (or read from ``PRIMERL_INFERENCE_POOL``, set by the launcher)."""

    @contextlib.contextmanager
    def servers(self, cfg: "RLConfig", *, quiet: bool = True) -> Iterator[Any]:
        """The servers this backend starts for a job on this machine, for the job's life (stopped on
        exit, failed or not); yields what it started, or None. Default: nothing to start."""
        yield None

    def pd_commands(self, cfg: "RLConfig") -> list[tuple[str, list[str], dict[str, str]]]:
        """``inference.pd``: ``[(role, argv, env)]`` of the prefill servers, decode servers and the
        router last (``pd_launch.PDDeployment`` starts them). Only asked when ``capabilities.pd``."""
        raise ConfigError(f"inference.pd: the inference backend {self.name!r} does not start P/D servers")

    @abstractmethod
    def weight_channel(self, cfg: "RLConfig", *, model, transport: "FileTransport", rank: int) -> "WeightChannel":
        """The trainer's channel, made on every rank (``rank``: the trainer rank)."""

    @abstractmethod
    def weight_receiver(self, cfg: "RLConfig", client: InferenceClient,
                        transport: "FileTransport") -> "WeightVersions":
        """The orchestrator's ``WeightVersions`` for ``client`` (made by :meth:`make_client`)."""

    @abstractmethod
    def generate_server(self, cfg: "RLConfig", client: InferenceClient, *, policy_version: Callable[[], int],
                        model_name: str) -> GenerateServer:
        """The verifiers path's generate route in front of ``client`` (not started)."""

    def make_teacher_client(self, cfg: "RLConfig", path: str, *, name: str = "teacher"):
        """``[distill]``: the client that scores sequences under the teacher at ``path`` on this
        backend's server at ``distill.url`` (``teacher_clients``: ``score(sequences) -> per-token
        log-probs``), or None without ``distill.url``: the teacher's model then runs in the
        orchestrator's process, on the engine's device (``orchestrator.teacher_scoring``). A backend
        whose servers can score overrides this; the default has no scoring route."""
        if cfg.distill.url:
            raise ConfigError(f"distill.url: the inference backend {self.name!r} has no scoring route; score "
                              f"in-process (leave distill.url empty), got {cfg.distill.url!r}")
        return None

    @abstractmethod
    def inference_plan(self, cfg: "RLConfig", model, layout, device_memory: float):
        """``memory_plan.InferencePlan`` of one inference server for ``model`` (a ``MoETransformerConfig``)."""


BACKENDS: Registry[InferenceBackend] = Registry(
    "inference backend", "inference.backend",
    ("primerl.runtime.inference.embedded_backend", "primerl.runtime.inference.vllm_backend"),
    "primerl.inference_backends")

_instances: dict[str, InferenceBackend] = {}


def register_backend(name: str, backend: InferenceBackend | type | None = None):
    """Register ``backend`` (an instance, or a class: instantiated once) under ``name``; without
    ``backend``, a class decorator. Re-registering a name with another object raises ValueError."""
    if backend is None:
        def decorate(obj):
            register_backend(name, obj)
            return obj
        return decorate
    BACKENDS.register(name, backend)
    return backend


def get_backend(name_or_cfg) -> InferenceBackend:
    """The backend named ``name_or_cfg`` (or ``cfg.inference.backend``); unknown: ``ConfigError``
    listing the registered ones."""
    name = name_or_cfg if isinstance(name_or_cfg, str) else name_or_cfg.inference.backend
    obj = BACKENDS.get(name)
    if isinstance(obj, type):
        if name not in _instances:
            _instances[name] = obj()
        obj = _instances[name]
    if not isinstance(obj, InferenceBackend):
        raise ConfigError(f"inference.backend: {name!r} is registered as {obj!r}, not an InferenceBackend")
    return obj


def _refuse(key: str, backend: InferenceBackend, what: str, capability: str, value) -> ConfigError:
    return ConfigError(f"{key}: {what}, which the inference backend {backend.name!r} does not offer "
                       f"(capabilities.{capability} is false), got {value!r}")


def check_backend(cfg: "RLConfig") -> None:
    """``inference.backend`` is registered; the config asks for nothing its capabilities lack; then
    the backend's own checks. Raises ``ConfigError`` naming the key."""
    b = get_backend(cfg)
    c, i, v = b.capabilities, cfg.inference, cfg.inference.vllm
    if i.pd.enabled and not c.pd:
        raise _refuse("inference.pd", b, "prefill and decode servers (inference.pd.prefill / decode > 0)", "pd",
                      {"prefill": i.pd.prefill, "decode": i.pd.decode})
    if i.weight_update == "broadcast" and not c.broadcast:
        raise _refuse("inference.weight_update", b, "'broadcast' sends the weights by torch.distributed",
                      "broadcast", i.weight_update)
    if v.weight_update == "broadcast" and not c.broadcast:
        raise _refuse("inference.vllm.weight_update", b, "'broadcast' sends the weights by torch.distributed",
                      "broadcast", v.weight_update)
    if cfg.trainer.router_replay and i.capture_routing and not c.routed_experts:
        raise _refuse("trainer.router_replay", b, "replay needs the sampler's routed experts (captured by inference)",
                      "routed_experts", True)
    if isinstance(i.num_servers, int) and i.num_servers > 1 and not c.server_pool:
        raise _refuse("inference.num_servers", b, "> 1 starts a pool of servers behind a router", "server_pool",
                      i.num_servers)
    if v.urls and not c.external_servers:
        raise _refuse("inference.vllm.urls", b, "external servers behind a router", "external_servers", v.urls)
    if v.launch and not c.launch:
        raise _refuse("inference.vllm.launch", b, "starting the backend's own server", "launch", v.launch)
    wt = i.weight_transfer
    if wt.dtype != "auto" and not c.weight_transfer:
        raise _refuse("inference.weight_transfer.dtype", b, f"{wt.dtype!r} in transit needs a receiver that takes "
                      "the bucketed transfer", "weight_transfer", wt.dtype)
    if wt.delta and not c.weight_transfer:
        raise _refuse("inference.weight_transfer.delta", b, "a delta needs a receiver that takes the bucketed "
                      "transfer", "weight_transfer", wt.delta)
    if cfg.deployment.inference_nodes and not c.inference_nodes:
        raise _refuse("deployment.inference_nodes", b, "inference servers on nodes of their own", "inference_nodes",
                      cfg.deployment.inference_nodes)
    b.check(cfg)
