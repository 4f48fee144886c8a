"""``FsdpGroups``: the process groups FSDP collectives run on, created once per process.

NOTE [why two communicators]: one communicator runs one collective at a time: a reduce-scatter queued
behind a prefetching all-gather waits for it. With a group of their own, one unit's reduce-scatter and the
next unit's all-gather run at once. Every rank must issue both groups' collectives in the same order, or
they deadlock: the passes make the schedule a pure function of the graph.

NOTE [one gloo thread per group]: gloo runs a group's collectives on two worker threads, and with two in
flight the process soon dies on a corrupt heap ("malloc(): unaligned tcache chunk detected"): each worker
sets the group's last-completed work name without a lock. So on gloo each FSDP group is a new group of
``_compat.serial_gloo()``: one worker thread, one collective at a time (as NCCL), the two groups concurrent.
"""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from fsdp_compile._compat import group_timeout_s, serial_gloo
from fsdp_compile.safety import peers

__all__ = ["Dedicated", "FsdpGroups"]


class Dedicated(str, enum.Enum):
    """Which collective gets a communicator of its own (see NOTE [why two communicators])."""

    REDUCE_SCATTER = "reduce_scatter"  # all-gathers on the base group
    ALL_GATHER = "all_gather"  # reduce-scatters on the base group
    NONE = "none"  # one communicator for both


@dataclass(eq=False)
class FsdpGroups:
    """The all-gather group, the reduce-scatter group and, for HSDP, the replicate group.

    Build it once per process with :meth:`create`, pass it to every ``fully_shard`` call, and :meth:`destroy`
    it at the end (which also ends the heartbeat of the cross-rank checks, NOTE [peers]).
    """

    all_gather: ProcessGroup
    reduce_scatter: ProcessGroup
    dedicated: Dedicated
    replicate: ProcessGroup | None = None
    _owned: list[ProcessGroup] = field(default_factory=list, repr=False)
    _heartbeat: bool = field(default=False, repr=False)  # holds a peers.start()

    @classmethod
    def create(cls, mesh: DeviceMesh | ProcessGroup | None = None, *,
               dedicated: str | Dedicated = Dedicated.REDUCE_SCATTER) -> FsdpGroups:
        """Make the groups for data parallelism over ``mesh``; collective.

        ``mesh``: ``None`` (WORLD), a ``ProcessGroup`` or 1-D ``DeviceMesh``, or a 2-D ``DeviceMesh`` of shape
        ``(replicate, shard)`` for HSDP. ``dedicated``: which collective gets a communicator of its own.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("FsdpGroups.create: no default process group is initialised; call "
                             "torch.distributed.init_process_group('gloo' or 'nccl') first (under torchrun, or with "
                             "MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set).")
        try:
            mode = Dedicated(dedicated)
        except ValueError:
            raise ValueError(
                f"FsdpGroups.create: dedicated={dedicated!r} is not one of "
                f"{[d.value for d in Dedicated]}; pass 'reduce_scatter' (default), 'all_gather' or 'none'."
            ) from None
        replicate: ProcessGroup | None = None
        if mesh is None:
            base = dist.group.WORLD
        elif isinstance(mesh, ProcessGroup):
            base = mesh
        elif isinstance(mesh, DeviceMesh):
            if mesh.ndim == 1:
                base = mesh.get_group(0)
            elif mesh.ndim == 2:
                replicate, base = mesh.get_group(0), mesh.get_group(1)
            else:
                raise ValueError(f"FsdpGroups.create: a {mesh.ndim}-D DeviceMesh is not supported; pass a 1-D mesh "
                                 "(shard) or a 2-D mesh (replicate, shard), e.g. init_device_mesh(dev, (r, s)).")
        else:
            raise TypeError(f"FsdpGroups.create: mesh must be None, a ProcessGroup or a DeviceMesh, not "
                            f"{type(mesh).__name__}.")
        assert base is not None
        owned: list[ProcessGroup] = []
        serial = dist.get_backend(base) == "gloo"  # NOTE [one gloo thread per group]

        def new(like: ProcessGroup, desc: str) -> ProcessGroup:
            owned.append(_same_ranks_group(like, desc=desc, backend=serial_gloo() if serial else None))
            return owned[-1]

        if mode is Dedicated.NONE:
            ag = rs = new(base, "fsdp") if serial else base
        else:
            extra = new(base, f"fsdp_{mode.value}")
            other = new(base, "fsdp_base") if serial else base
            ag, rs = (other, extra) if mode is Dedicated.REDUCE_SCATTER else (extra, other)
        if serial and replicate is not None:
            replicate = new(replicate, "fsdp_replicate")
        peers.start()
        return cls(all_gather=ag, reduce_scatter=rs, dedicated=mode, replicate=replicate, _owned=owned,
                   _heartbeat=True)

    @property
    def shard_size(self) -> int:
        """Ranks a parameter is sharded over."""
        return self.all_gather.size()

    @property
    def replicate_size(self) -> int:
        """Replicas of each shard (1 without HSDP)."""
        return 1 if self.replicate is None else self.replicate.size()

    def destroy(self) -> None:
        """Destroy the groups this object created, and release its share of the heartbeat (NOTE [peers])."""
        for pg in self._owned:
            dist.destroy_process_group(pg)
        self._owned.clear()
        if self._heartbeat:
            self._heartbeat = False
            peers.release()


def _same_ranks_group(base: ProcessGroup, *, desc: str, backend: str | None) -> ProcessGroup:
    """Another communicator over the ranks of ``base`` (every rank of WORLD makes a twin of every such group)."""
    ranks = dist.get_process_group_ranks(base)
    timeout = datetime.timedelta(seconds=group_timeout_s(base))
    if base is dist.group.WORLD or len(ranks) == dist.get_world_size():
        pg = dist.new_group(ranks=ranks, group_desc=desc, backend=backend, timeout=timeout)
    else:
        all_groups: list[list[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(all_groups, ranks)
        pg = None
        for group_ranks in sorted({tuple(r) for r in all_groups if r is not None}):
            made = dist.new_group(ranks=list(group_ranks), group_desc=desc, backend=backend, timeout=timeout)
            if list(group_ranks) == ranks:
                pg = made
    assert pg is not None
    return pg
