"""``init_process_group`` under mpiexec without MASTER_ADDR/MASTER_PORT.

torch's default ``env://`` rendezvous needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.  When
any of these is missing and the process runs under an MPI launcher, the wrapped handler fills the
gap from MPI at ``init_process_group`` time (never at import): rank and size from
``MPI.COMM_WORLD``, and the job's store from :func:`torchhpc.runtime.world.agree_on_master` (the package's one
MPI rendezvous).  Values the user did set are used as they are (and checked
against MPI).  Without an MPI launcher the original handler runs untouched, so its usual error
about the missing variables still appears.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
import torch.distributed.rendezvous  # noqa: F401  (loads the module; the name is shadowed by a function)

from ..runtime.world import agree_on_master, job_store, mpi_launcher

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
        store = job_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, rank == 0, timeout)
    else:
        store = agree_on_master(size, timeout.total_seconds(), "init_process_group")
    yield (store, rank, size)
    raise RuntimeError("accl rendezvous: re-rendezvous is not supported")


def install_env_rendezvous() -> None:
    """Wrap torch's ``env://`` handler once (idempotent)."""
    global _original
    if _original is not None:
        return
    _original = _handlers()["env"]
    _handlers()["env"] = _mpi_env_handler


def _handlers() -> dict:
    return sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
