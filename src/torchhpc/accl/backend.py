"""Registration of the ``"accl"`` backend with torch.distributed, and group creation over MPI."""

from __future__ import annotations

import itertools
import threading

import torch.distributed as dist
from mpi4py import MPI

from .options import AcclOptions
from .process_group import ProcessGroupACCL
from .rendezvous import install_env_rendezvous

__all__ = ["register", "create_process_group"]

_lock = threading.Lock()
_world_comm: MPI.Comm | None = None  # MPI ranks ordered as torch's global ranks
_create_tag = itertools.count(101)


def _global_comm(group_rank: int, group_size: int, is_default: bool) -> MPI.Comm:
    """A communicator whose rank i is torch's global rank i."""
    global _world_comm
    world = MPI.COMM_WORLD
    if is_default:
        if group_size != world.Get_size():
            raise RuntimeError(f"accl: torch world_size {group_size} differs from the MPI job size "
                               f"{world.Get_size()}; the accl backend needs one torch rank per MPI process")
        comm = world if group_rank == world.Get_rank() else world.Split(0, group_rank)
        _world_comm = comm
        return comm
    if _world_comm is not None:
        return _world_comm
    # default group from another backend (e.g. gloo): its ranks must be MPI's
    if dist.is_initialized() and dist.get_rank() != world.Get_rank():
        raise RuntimeError("accl: the default group's ranks differ from MPI_COMM_WORLD's; create the "
                           "default group with the accl backend, or launch so that RANK matches the MPI rank")
    return world


def create_process_group(dist_opts, pg_options=None) -> ProcessGroupACCL:
    """``Backend.register_backend`` creator (extended API): builds the group's MPI communicator."""
    if pg_options is not None and not isinstance(pg_options, AcclOptions):
        raise TypeError(f"accl: pg_options must be torchhpc.accl.AcclOptions, "
                        f"got {type(pg_options).__name__}")
    ranks = list(dist_opts.global_ranks_in_group)
    rank, size = dist_opts.group_rank, dist_opts.group_size
    with _lock:
        base = _global_comm(rank, size, is_default=not ranks)
        if not ranks or ranks == list(range(base.Get_size())):
            comm = base
        else:
            group = base.Get_group().Incl(ranks)
            comm = base.Create_group(group, next(_create_tag) % 30000)
            group.Free()
    return ProcessGroupACCL(comm, rank, size, dist_opts.timeout, pg_options, str(dist_opts.group_id))


def register() -> None:
    """Make ``init_process_group("accl")`` work (idempotent)."""
    if "ACCL" not in dist.Backend._plugins:
        dist.Backend.register_backend("accl", create_process_group, extended_api=True,
                                      devices=["cpu", "cuda"])
    install_env_rendezvous()
