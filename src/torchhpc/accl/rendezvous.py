"""``init_process_group`` under mpiexec without MASTER_ADDR/MASTER_PORT.

torch's default ``env://`` rendezvous needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.  When
any of these is missing and the process runs under an MPI launcher, the wrapped handler fills the
gap from MPI at ``init_process_group`` time (never at import): rank and size from
``MPI.COMM_WORLD``, and a TCPStore that rank 0 opens on a free port it picks itself, listening on
the job's interface only (loopback for a job on one node), whose address reaches the others by
``MPI_Bcast``.  Values the user did set are used as they are (and checked
against MPI).  Without an MPI launcher the original handler runs untouched, so its usual error
about the missing variables still appears.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
import torch.distributed.rendezvous  # noqa: F401  (loads the module; the name is shadowed by a function)

from ..errors import RemoteError
from ..launcher import job_store, mpi_launcher
from ..waiting import wait_requests

__all__ = ["install_env_rendezvous", "under_mpi_launcher"]

_original = None


def under_mpi_launcher() -> bool:
    """True when an MPI launcher (Open MPI, MPICH/Hydra, PALS, MVAPICH) started this process
    (:func:`torchhpc.launcher.mpi_launcher`, the package's one detector)."""
    return mpi_launcher() is not None


def _mpi_env_handler(url: str, timeout: timedelta = dist.default_pg_timeout, **kwargs):
    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    have_addr = bool(os.environ.get("MASTER_ADDR")) and bool(os.environ.get("MASTER_PORT"))
    have_rank = "rank" in query or bool(os.environ.get("RANK"))
    have_size = "world_size" in query or bool(os.environ.get("WORLD_SIZE"))
    if (have_addr and have_rank and have_size) or not under_mpi_launcher():
        yield from _original(url, timeout=timeout, **kwargs)
        return

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = int(query.get("rank", os.environ.get("RANK") or world.Get_rank()))
    size = int(query.get("world_size", os.environ.get("WORLD_SIZE") or world.Get_size()))
    if size != world.Get_size():
        raise ValueError(f"accl rendezvous: WORLD_SIZE={size} but the MPI job has {world.Get_size()} "
                         f"processes; unset WORLD_SIZE or launch {size} ranks")
    if have_addr:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = job_store(addr, port, size, rank == 0, timeout)
    else:
        store = None
        buf = bytearray(1024)  # "ok <host> <port>" or "error <message>", from rank 0
        one_node = _one_node(world)  # collective: every rank splits
        if world.Get_rank() == 0:
            try:
                host = "127.0.0.1" if one_node else _reachable_host()
                store = job_store(host, 0, size, True, timeout)
                text = f"ok {host} {store.port}"
            except Exception as exc:  # noqa: BLE001 - tell the other ranks too
                text = f"error {type(exc).__name__}: {exc}"
            raw = text.encode(errors="replace")[: len(buf)]
            buf[: len(raw)] = raw
        wait_requests([world.Ibcast([buf, MPI.BYTE], root=0)], timeout.total_seconds(),
                      "accl rendezvous: the TCPStore address from rank 0 (every rank must call "
                      "init_process_group)", keep=buf)
        status, _, rest = bytes(buf).rstrip(b"\0").decode(errors="replace").partition(" ")
        if status != "ok":
            raise RemoteError(f"accl rendezvous: rank 0 could not open a TCPStore: {rest}", 0, rest)
        host, port = rest.split()
        if store is None:
            store = job_store(host, int(port), size, False, timeout)
    yield (store, rank, size)
    raise RuntimeError("accl rendezvous: re-rendezvous is not supported")


def _one_node(world) -> bool:  # noqa: ANN001 (an mpi4py communicator)
    """Whether every rank of ``world`` is on this node (collective): the store then listens on loopback only."""
    from mpi4py import MPI

    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size() == world.Get_size()
    finally:
        node.Free()


def _reachable_host() -> str:
    """An address of this host that the other ranks can connect to."""
    host = socket.gethostname()
    try:
        socket.getaddrinfo(host, None)
        return host
    except OSError:
        return "127.0.0.1"


def install_env_rendezvous() -> None:
    """Wrap torch's ``env://`` handler once (idempotent)."""
    global _original
    if _original is not None:
        return
    _original = _handlers()["env"]
    _handlers()["env"] = _mpi_env_handler


def _handlers() -> dict:
    return sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
