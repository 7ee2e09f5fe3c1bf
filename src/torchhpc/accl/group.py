"""``ProcessGroupACCL``: torch's ``ProcessGroup`` over accl's C++ ``c10d::Backend``.

The group is torch's own ``ProcessGroup`` with accl's ``c10d::Backend`` (``csrc/``, loaded by
:func:`.core.load_backend`) registered for ``cpu`` and ``cuda``: torch's dispatcher hands every collective and
point-to-point call to the C++ class, which owns checks, the header exchange, segmenting, ordering, deadlines
and completion.  This class identifies the group (its name, options, counters) and adds the one call torch
gives only gloo, :meth:`ProcessGroupACCL.monitored_barrier`: torch's dispatcher never reaches it, so it is written
here over mpi4py, on a communicator of its own (no user message can match its tokens).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ..runtime import waiting
from ..runtime.errors import PeerTimeoutError
from . import core
from .options import AcclOptions

__all__ = ["ProcessGroupACCL"]

_TOKEN, _RELEASE = 1, 2  # the monitored barrier's tags, on its own communicator


def _monitored_text(missing: list[int], timeout: timedelta, wait_all: bool) -> str:
    """Rank 0's report of the ranks that did not arrive, in gloo's words (``ProcessGroupGloo::monitoredBarrier``)."""
    ms, ranks = int(timeout.total_seconds() * 1000 + 0.5), ", ".join(map(str, missing))
    words = f"[Rank 0]: Rank {missing[0]} failed to pass monitoredBarrier in {ms} ms"
    if wait_all:
        words = f"[Rank 0]: Ranks {ranks} failed to pass monitoredBarrier in {ms} ms"
    elif ms == 0:  # gloo checks the time left before each rank's wait: none was left for any
        words = ("Rank 0 timed out in monitoredBarrier after 0 ms. No ranks successfully processed in "
                 f"monitoredBarrier. Failing rank: {missing[0]}")
    return f"accl: {words} (missing: ranks [{ranks}])"


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
        self._timeout = timeout
        self._monitor = comm.Dup()  # the monitored barrier's (collective, as the group's construction is)
        self._backend = core.load_backend().ProcessGroupACCL(comm.py2f(), opts.backend_options(timeout,
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
        """Barrier that names the ranks that did not arrive within ``timeout`` (default: the group's), as gloo's
        does: rank 0 raises for the first missing rank, or for every one with ``wait_all_ranks=True``; a rank
        that arrived but got no release raises too.  ``dist.monitored_barrier`` itself accepts only gloo
        groups; call this method on the group."""
        timeout = self._timeout if timeout is None else timeout
        comm, secs, what = self._monitor, max(timeout.total_seconds(), 0.0), "monitored_barrier"
        if comm.Get_rank() != 0:  # a token to rank 0, then its release
            token, ack = np.zeros(1, np.int64), np.zeros(1, np.int64)
            sent, release = comm.Isend(token, 0, _TOKEN), comm.Irecv(ack, 0, _RELEASE)
            try:
                waiting.wait_requests([release], secs, what, cancel=True, keep=ack)
            except PeerTimeoutError:
                waiting.ABANDONED.append(([sent], token))  # rank 0 may still take the token later
                raise PeerTimeoutError(f"accl: Rank {comm.Get_rank()} successfully reached monitoredBarrier, but "
                                       f"got no release from rank 0 within {secs:g} s. Please check rank 0's error "
                                       "for the faulty ranks.") from None
            sent.Wait()
            return
        tokens = np.zeros(comm.Get_size(), np.int64)
        pending = {r: comm.Irecv(tokens[r:r + 1], r, _TOKEN) for r in range(1, comm.Get_size())}

        def arrived() -> bool:
            for r in [r for r, q in pending.items() if q.Test()]:
                del pending[r]
            return not pending

        try:
            waiting.wait_until(arrived, secs, what)
        except PeerTimeoutError:
            missing = []
            for r, q in sorted(pending.items()):
                q.Cancel()  # withdrawn, so that no later token matches it
                status = MPI.Status()
                q.Wait(status)
                if status.Is_cancelled():  # (else its token arrived after all)
                    missing.append(r)
            if missing:
                raise PeerTimeoutError(_monitored_text(missing, timeout, wait_all_ranks)) from None
        waiting.wait_requests([comm.Isend(tokens[:1], r, _RELEASE) for r in range(1, comm.Get_size())],
                              self._timeout.total_seconds(), f"{what}'s release", keep=tokens)

    def shutdown(self) -> None:
        """The group's end (torch's ``destroy_process_group`` calls it): the backend's communicators are freed,
        and the monitored barrier's."""
        super().shutdown()
        if self._monitor != MPI.COMM_NULL and not MPI.Is_finalized():
            self._monitor.Free()

    @property
    def stats(self) -> MutableMapping[str, int]:
        """Engine calls made, calls sidestepped to MPI, the largest bytes of one call's buffer, and collectives
        that went to the queue (async, or behind pending work) rather than running in their caller's thread.
        Settable, e.g. ``stats["max_call_bytes"] = 0`` before a measurement."""
        return _Counters(self._backend.stats)


class _Counters(MutableMapping[str, int]):
    """The C++ backend's counters by name: its ``Stats`` properties, named once in module.cpp; they can be set but
    not removed."""

    def __init__(self, stats) -> None:
        self._stats = stats
        self._names = tuple(k for k, v in vars(type(stats)).items() if isinstance(v, property))

    def _name(self, key: str) -> str:
        if key not in self._names:
            raise KeyError(key)
        return key

    def __getitem__(self, key: str) -> int:
        return getattr(self._stats, self._name(key))

    def __setitem__(self, key: str, value: int) -> None:
        setattr(self._stats, self._name(key), value)

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"accl's counter {key!r} cannot be removed; set it to 0 instead")

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
