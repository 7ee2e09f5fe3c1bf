"""``ProcessGroupACCL``: torch's ``ProcessGroup`` over accl's C++ ``c10d::Backend``.

The group is torch's own ``ProcessGroup`` with accl's ``c10d::Backend`` (``csrc/``, loaded by
:func:`.core.load_backend`) registered for ``cpu`` and ``cuda``: torch's dispatcher hands every collective and
point-to-point call to the C++ class, which owns checks, the header exchange, segmenting, ordering, deadlines
and completion.  This class identifies the group (its name, options, counters) and adds the one call torch
gives only gloo: :meth:`ProcessGroupACCL.monitored_barrier`.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI

from . import core
from .options import AcclOptions

__all__ = ["ProcessGroupACCL"]


class ProcessGroupACCL(dist.ProcessGroup):
    """A process group whose calls all run in accl's C++ backend over an MPI communicator."""

    def __init__(self, comm: MPI.Comm, rank: int, size: int, timeout: timedelta,
                 options: AcclOptions | None = None, group_name: str = "",
                 global_ranks: list[int] | None = None) -> None:
        super().__init__(rank, size)
        if comm.Get_rank() != rank or comm.Get_size() != size:
            raise RuntimeError(f"accl: MPI communicator is rank {comm.Get_rank()} of {comm.Get_size()} "
                               f"but torch expects rank {rank} of {size}")
        self.options = opts = options if options is not None else AcclOptions()
        accl_engine = None
        if opts.engine == "accl":
            from .accl_engine import AcclEngine  # pyaccl's driver: imported only when asked for

            accl_engine = AcclEngine(comm, opts)
        self._accl_engine = accl_engine  # the Python half of the C++ engine: alive as long as the group
        self._backend = core.load_backend().ProcessGroupACCL(MPI._handleof(comm), opts.backend_options(timeout,
                                                             group_name), accl_engine)
        if global_ranks:  # torch's global ranks (none for the world): the flight record names members by them
            self._backend.set_global_ranks(list(global_ranks))
        kind = dist.ProcessGroup.BackendType.CUSTOM
        for device in ("cpu", "cuda"):
            self._register_backend(torch.device(device), kind, self._backend)
        self._set_default_backend(kind)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "accl"

    def __repr__(self) -> str:
        return f"ProcessGroupACCL(rank={self.rank()}, size={self.size()}, engine={self.engine_name})"

    @property
    def engine_name(self) -> str:
        """The engine carrying out this group's collectives: ``mpi`` or ``accl``."""
        return self._backend.engine_name

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """Barrier that names the ranks that did not arrive within ``timeout``, as gloo's does: rank 0 raises for
        the first missing rank, or for every one with ``wait_all_ranks=True``.  ``dist.monitored_barrier``
        itself accepts only gloo groups; call this method on the group."""
        secs = timeout.total_seconds() if timeout is not None else -1.0  # negative: the group's timeout
        self._backend.monitored_barrier(secs, wait_all_ranks)

    @property
    def stats(self) -> MutableMapping[str, int]:
        """Engine calls made, calls sidestepped to MPI, the largest bytes of one call's buffer, and collectives
        that went to the queue (async, or behind pending work) rather than running in their caller's thread.
        Settable, e.g. ``stats["max_call_bytes"] = 0`` before a measurement."""
        return self._backend.stats
