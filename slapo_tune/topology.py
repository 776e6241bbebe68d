"""The one place that turns ``(dp, pp, tp, cp)`` into process groups.

Ranks are laid out on a ``(pp, dp, cp, tp)`` device mesh: tensor-parallel ranks are adjacent (the
fastest links carry the most traffic), context-parallel ranks next (they all-gather keys and values
every attention), pipeline stages are outermost (they communicate least). Context-parallel ranks
hold the same parameters and see different tokens of the same sequences: their gradients are
summed over the cp group (:class:`~slapo_tune.runtime.TrainStep`); ZeRO shards over dp only.
Schedules receive their groups from a :class:`Topology`; nothing else creates groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import ProcessGroup

from .errors import UsageError
from .launch import loopback_environment


@dataclass
class Topology:
    """Process groups and this rank's coordinates for a ``dp x pp x tp`` layout."""

    dp: int
    pp: int
    tp: int
    cp: int = 1
    dp_rank: int = 0
    pp_rank: int = 0
    tp_rank: int = 0
    cp_rank: int = 0
    mesh: object | None = field(default=None, repr=False)
    tp_group: ProcessGroup | None = field(default=None, repr=False)
    dp_group: ProcessGroup | None = field(default=None, repr=False)
    pp_group: ProcessGroup | None = field(default=None, repr=False)
    # context parallelism: the ranks that split each sequence (same pp, dp and tp coordinates)
    cp_group: ProcessGroup | None = field(default=None, repr=False)
    # {first stage, last stage} ranks at this rank's (dp, tp) coordinate: tied embeddings sum here
    tie_group: ProcessGroup | None = field(default=None, repr=False)
    # the pipeline's ranks again, for collectives (the loss), kept apart from its point-to-point group
    pp_sync_group: ProcessGroup | None = field(default=None, repr=False)
    pp_global_ranks: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def dp_mesh(self):
        """The data-parallel sub-mesh (what FSDP shards over)."""
        return None if self.mesh is None else self.mesh["dp"]

    def __str__(self) -> str:
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        cp_rank = f", cp {self.cp_rank}" if self.cp > 1 else ""
        return (f"dp={self.dp} x pp={self.pp} x tp={self.tp}{cp} "
                f"(rank: dp {self.dp_rank}, pp {self.pp_rank}, tp {self.tp_rank}{cp_rank})")


def factorize(world_size: int, pp: int = 1, tp: int = 1, dp: int | None = None, cp: int = 1) -> tuple[int, int, int]:
    """``(dp, pp, tp)`` with ``dp * pp * tp * cp == world_size``; ``dp`` defaults to what is left."""
    for name, value in (("pp", pp), ("tp", tp), ("cp", cp)):
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if world_size % (pp * tp * cp):
        what = f"pp x tp x cp = {pp} x {tp} x {cp}" if cp > 1 else f"pp x tp = {pp} x {tp}"
        raise UsageError(f"world size {world_size} is not divisible by {what}")
    rest = world_size // (pp * tp * cp)
    if dp is None:
        dp = rest
    elif dp != rest:
        raise UsageError(f"dp x pp x tp x cp = {dp} x {pp} x {tp} x {cp} = {dp * pp * tp * cp}, "
                         f"but the world size is {world_size}")
    return dp, pp, tp


def _ensure_process_group(device_type: str) -> None:
    if not dist.is_initialized():
        # A single process still runs through the same distributed code path (groups of size 1).
        # It has no peer: gloo's listeners (this group's and the mesh's, which follow
        # GLOO_SOCKET_IFNAME, else the address the hostname resolves to) go on the loopback.
        os.environ.update(loopback_environment())
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def init_topology(pp: int = 1, tp: int = 1, dp: int | None = None, device_type: str = "cpu", cp: int = 1) -> Topology:
    """Create the mesh and every group for this layout. All ranks must call it, in the same order.

    Initialises a one-process group when torch.distributed is not initialised (world size 1).
    """
    _ensure_process_group(device_type)
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    dp, pp, tp = factorize(world, pp=pp, tp=tp, dp=dp, cp=cp)
    if cp > 1:
        mesh = init_device_mesh(device_type, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
        pp_rank, dp_rank, cp_rank, tp_rank = mesh.get_coordinate()
        layout = mesh.mesh.tolist()
        cp_group = mesh.get_group("cp")
    else:
        mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        pp_rank, dp_rank, tp_rank = mesh.get_coordinate()
        cp_rank, cp_group = 0, None
        layout = [[[row] for row in stage] for stage in mesh.mesh.tolist()]  # [pp][dp][cp=1][tp]
    pp_group = pp_sync_group = mesh.get_group("pp")
    tie_group = None
    if pp > 1:
        # Pipeline point-to-point traffic gets groups of its own: a mesh dimension spanning the
        # whole world is the default group, and gloo can match a pending send of a pipeline with a
        # later collective on the same group (an intermittent hang).
        for i in range(dp):
            for c in range(cp):
                for j in range(tp):
                    stages = [layout[s][i][c][j] for s in range(pp)]
                    group = dist.new_group(stages)
                    sync = dist.new_group(stages)
                    tie = dist.new_group([stages[0], stages[-1]])
                    if (i, c, j) == (dp_rank, cp_rank, tp_rank):
                        pp_group, pp_sync_group, tie_group = group, sync, tie
    pp_ranks = tuple(layout[s][dp_rank][cp_rank][tp_rank] for s in range(pp))
    return Topology(
        dp=dp, pp=pp, tp=tp, dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank, mesh=mesh,
        tp_group=mesh.get_group("tp"), dp_group=mesh.get_group("dp"), pp_group=pp_group,
        tie_group=tie_group, pp_sync_group=pp_sync_group, pp_global_ranks=pp_ranks,
        cp=cp, cp_rank=cp_rank, cp_group=cp_group,
    )
