"""Parallel layout: how the ranks split into data-parallel, context-parallel and expert-parallel groups.

Rank order: ``dp_replicate`` outermost, then ``dp_shard``, then ``cp`` (fastest), so
``rank = (r * dp_shard + s) * cp + c``. Expert parallelism borrows from the ``dp_shard x cp``
block: with ``f = s * cp + c`` the position inside that block, the ``ep`` group of a rank is the
run of ``ep`` consecutive positions ``f // ep`` and its ``efsdp`` group (the ranks that hold the
same experts and shard them, FSDP-style) is the positions with the same ``f % ep``.

Named views of the mesh ``build_mesh`` returns:

=============== ============================== ==============================================
view            size                           use
=============== ============================== ==============================================
dp_replicate    dp_replicate                   HSDP replication (gradients all-reduced)
dp_shard        dp_shard                       data sharding
cp              cp                             context parallel (ring attention)
dp_shard_cp     dp_shard * cp                  FSDP of dense parameters
ep              ep                             expert parallel (token all-to-all)
efsdp           dp_shard * cp / ep             FSDP of expert parameters
batch           dp_replicate * dp_shard        data loading: ranks that read different samples
loss            dp_replicate * dp_shard * cp   global token count for the loss normalisation
=============== ============================== ==============================================

So that every view is a plain (flattened) slice of one DeviceMesh, ``ep`` and ``cp`` must nest:
one divides the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a layout is read without torch (the launcher): torch.distributed is loaded to build one
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "build_mesh", "MESH_VIEWS"]

MESH_VIEWS = ("dp_replicate", "dp_shard", "cp", "dp_shard_cp", "ep", "efsdp", "batch", "loss")


def _positive(name: str, value, allow_infer: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or (allow_infer and value == -1)):
        want = "a positive int or -1 (infer)" if allow_infer else "a positive int"
        raise ValueError(f"ParallelDims: {name} must be {want}, got {value!r}")


@dataclass
class ParallelDims:
    """Sizes of the parallel dimensions; ``dp_shard=-1`` takes what the world size leaves.

    ``world_size=None`` reads it from torch.distributed. ``num_experts``, when given, is checked
    against ``ep`` (``check_num_experts`` does the same later).
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    ep: int = 1
    world_size: int | None = None
    num_experts: int | None = field(default=None, kw_only=True)

    def __post_init__(self):
        if self.world_size is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("ParallelDims: world_size=None needs an initialized torch.distributed")
            self.world_size = dist.get_world_size()
        _positive("world_size", self.world_size)
        _positive("dp_replicate", self.dp_replicate)
        _positive("dp_shard", self.dp_shard, allow_infer=True)
        _positive("cp", self.cp)
        _positive("ep", self.ep)
        rest = self.dp_replicate * self.cp
        if self.dp_shard == -1:
            if self.world_size % rest:
                raise ValueError(f"ParallelDims: cannot infer dp_shard: world_size={self.world_size} is not divisible "
                                 f"by dp_replicate * cp = {self.dp_replicate} * {self.cp} = {rest}")
            self.dp_shard = self.world_size // rest
        if self.dp_replicate * self.dp_shard * self.cp != self.world_size:
            raise ValueError(f"ParallelDims: dp_replicate * dp_shard * cp = {self.dp_replicate} * {self.dp_shard} * "
                             f"{self.cp} = {self.dp_replicate * self.dp_shard * self.cp} "
                             f"!= world_size={self.world_size}")
        if self.dp_shard_cp % self.ep:
            raise ValueError(f"ParallelDims: ep={self.ep} must divide dp_shard * cp = {self.dp_shard} * {self.cp} = "
                             f"{self.dp_shard_cp} (expert parallelism borrows those ranks)")
        if self.ep % self.cp and self.cp % self.ep:
            raise ValueError(f"ParallelDims: ep={self.ep} and cp={self.cp} must nest (one divides the other) so the "
                             f"ep groups are slices of the mesh")
        if self.num_experts is not None:
            self.check_num_experts(self.num_experts)

    def check_num_experts(self, num_experts: int) -> None:
        if num_experts % self.ep:
            raise ValueError(f"ParallelDims: num_experts={num_experts} is not divisible by ep={self.ep}")

    @property
    def dp_shard_cp(self) -> int:
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        return self.dp_shard_cp // self.ep

    @property
    def batch(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def loss(self) -> int:
        return self.world_size

    def view_sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_VIEWS}

    def view_ranks(self, rank: int) -> dict[str, list[int]]:
        """The ranks in each view that ``rank`` belongs to, in view order (the spec of build_mesh)."""
        R, S, C, ep = self.dp_replicate, self.dp_shard, self.cp, self.ep
        if not 0 <= rank < self.world_size:
            raise ValueError(f"view_ranks: rank {rank} outside [0, {self.world_size})")
        r, f = divmod(rank, S * C)
        s, c = divmod(f, C)
        block = r * S * C

        def at(rr, ss, cc):
            return (rr * S + ss) * C + cc

        return {
            "dp_replicate": [at(i, s, c) for i in range(R)],
            "dp_shard": [at(r, i, c) for i in range(S)],
            "cp": [at(r, s, i) for i in range(C)],
            "dp_shard_cp": [block + i for i in range(S * C)],
            "ep": [block + (f // ep) * ep + i for i in range(ep)],
            "efsdp": [block + i * ep + f % ep for i in range(S * C // ep)],
            "batch": [at(i, j, c) for i in range(R) for j in range(S)],
            "loss": list(range(self.world_size)),
        }

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        return build_mesh(self, device_type)


def build_mesh(parallel_dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """One DeviceMesh over all ranks whose named views (``mesh["ep"]``, ``mesh["dp_replicate",
    "efsdp"]``, ...) are the groups of the module docstring. Collective: every rank calls it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    p = parallel_dims
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_mesh: torch.distributed is not initialized")
    if dist.get_world_size() != p.world_size:
        raise ValueError(f"build_mesh: ParallelDims.world_size={p.world_size} but the process group has "
                         f"{dist.get_world_size()} ranks")
    if p.ep >= p.cp:  # ep = (ep / cp) dp_shard positions x all of cp
        names = ("dp_replicate", "efsdp", "_ep_from_dp_shard", "cp")
        sizes = (p.dp_replicate, p.efsdp, p.ep // p.cp, p.cp)
        views = {
            "dp_shard": ("efsdp", "_ep_from_dp_shard"),
            "ep": ("_ep_from_dp_shard", "cp"),
            "dp_shard_cp": ("efsdp", "_ep_from_dp_shard", "cp"),
            "batch": ("dp_replicate", "efsdp", "_ep_from_dp_shard"),
        }
    else:  # cp = (cp / ep) outer positions x ep
        names = ("dp_replicate", "dp_shard", "_cp_outside_ep", "ep")
        sizes = (p.dp_replicate, p.dp_shard, p.cp // p.ep, p.ep)
        views = {
            "cp": ("_cp_outside_ep", "ep"),
            "efsdp": ("dp_shard", "_cp_outside_ep"),
            "dp_shard_cp": ("dp_shard", "_cp_outside_ep", "ep"),
            "batch": ("dp_replicate", "dp_shard"),
        }
    views["loss"] = names
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    for view, dims in views.items():
        mesh[dims]._flatten(view)
    return mesh
