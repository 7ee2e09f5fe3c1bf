"""``init_distributed``: ``torch.distributed`` initialised from whatever launcher started this process.

The facts it starts from (who am I in this job, under torchrun, Open MPI, PALS, Hydra, MVAPICH, Slurm or
mpi4py; the job's rendezvous store) are :mod:`torchhpc.runtime.world`'s, re-exported here where users import
them.  This module sits above the runtime: it may import a capability (``backend="accl"`` imports
:mod:`torchhpc.accl`, which registers the backend).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Mapping

from .runtime.errors import LauncherError
from .runtime.world import (
    MPI_LAUNCHER_VARS,
    WorldInfo,
    agree_on_master,
    job_rendezvous,
    job_store,
    mpi_launcher,
    torchrun_store,
    world_info,
)

__all__ = ["LauncherError", "WorldInfo", "world_info", "mpi_launcher", "MPI_LAUNCHER_VARS", "init_distributed",
           "agree_on_master", "job_store"]


def _bind_gpu(info: WorldInfo) -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if info.local_size > count and count > 1:
        raise LauncherError(
            f"{info.local_size} ranks on this node but only {count} GPUs visible; "
            "run one rank per GPU or restrict CUDA_VISIBLE_DEVICES per rank"
        )
    device = info.local_rank % count
    torch.cuda.set_device(device)
    return device


def init_distributed(
    backend: str | None = None,
    timeout: datetime.timedelta | float = datetime.timedelta(minutes=10),
    *,
    env: Mapping[str, str] | None = None,
) -> WorldInfo:
    """Initialise ``torch.distributed`` from whatever launcher started this process.

    ``backend`` defaults to ``nccl`` when GPUs exist, else ``gloo``; ``"accl"`` imports :mod:`torchhpc.accl`.
    Missing ``MASTER_ADDR``/``MASTER_PORT`` are agreed on through MPI (or Slurm's node list), one GPU is bound
    per local rank, and the result of :func:`world_info` is returned.  Calling it again is a no-op.
    """
    import torch
    import torch.distributed as dist

    from .runtime.waiting import agreed

    environ = os.environ if env is None else env
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    # Every rank checks its own launch first; under an MPI launcher the ranks then agree, so that an error
    # on one rank (a bad environment, a missing backend) is an error on all, not a hang in the rendezvous.
    world = _mpi_world(environ) if env is None else None
    with agreed(world, timeout.total_seconds(), "torchhpc.launcher.init_distributed()") if world is not None \
            else contextlib.nullcontext():
        info = world_info(environ)
        already = dist.is_initialized()
        if already and (dist.get_rank(), dist.get_world_size()) != (info.rank, info.world_size):
            raise LauncherError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the launcher says {info.rank} of {info.world_size}"
            )
        if not already:
            backend = _checked_backend(backend)
            device = _bind_gpu(info)
    if already:
        return info

    kwargs: dict = {"backend": backend, "timeout": timeout}
    if backend != "mpi" and info.launcher == "torchrun" and env is None:
        kwargs.update(rank=info.rank, world_size=info.world_size, store=torchrun_store(info, timeout))
    elif backend != "mpi":
        # A store of our own rather than env://, so nothing is written into os.environ (children of this
        # process, e.g. a nested mpiexec, must not inherit a port this job owns), served on the job's interface.
        kwargs.update(rank=info.rank, world_size=info.world_size, store=job_rendezvous(info, environ, timeout))
    if device is not None and backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", device)
    # torch.distributed.nn.functional takes ``group.WORLD`` as a default argument; imported after the group
    # exists (DDP pulls it in through torch._dynamo) it pins the default group for good, so
    # destroy_process_group() cannot stop gloo's workers, and one still dropping a tensor when the
    # interpreter exits aborts the process ("terminate called without an active exception").
    import torch.distributed.nn.functional  # noqa: F401

    dist.init_process_group(**kwargs)
    return info


def _mpi_world(env: Mapping[str, str]):  # -> MPI.Comm | None
    """``MPI.COMM_WORLD`` when an MPI launcher started this job with several ranks, else None."""
    if mpi_launcher(env) is None:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


def _checked_backend(backend: str | None) -> str:
    """The backend name to use (default ``nccl`` with GPUs, else ``gloo``); refuses one this PyTorch lacks."""
    import torch
    import torch.distributed as dist

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    backend = backend.lower()
    if backend == "accl":
        import torchhpc.accl  # noqa: F401  (registers the backend)
    elif backend == "mpi" and not dist.is_mpi_available():
        raise LauncherError(
            "backend 'mpi' needs a PyTorch built with MPI (pip wheels have none): use backend='accl' "
            "(torchhpc's MPI backend for any PyTorch) or build PyTorch with `make build-pytorch-*`"
        )
    elif backend == "nccl" and not dist.is_nccl_available():
        raise LauncherError("backend 'nccl' requested but this PyTorch has no NCCL (CPU build?)")
    return backend
