"""``torchhpc.accl``: a complete torch.distributed backend ``"accl"`` over MPI (mpi4py) or ACCL.

Importing this package registers the backend::

    import torch.distributed as dist
    import torchhpc.accl  # noqa: F401  (registers "accl")

    dist.init_process_group("accl")  # under mpiexec: no MASTER_ADDR/MASTER_PORT needed

Every call runs in one C++ class, ``ProcessGroupACCL`` (a ``c10d::Backend``, ``csrc/``); this package registers
it and holds its options (:class:`AcclOptions`).  Its errors are :mod:`torchhpc.runtime.errors`' (``PeerTimeoutError``,
``PeerFailedError``, ``MismatchError``, ``EngineUnavailableError``).

Importing it registers the name and makes torch's ``env://`` rendezvous read an MPI launcher's variables; the
first accl group a process makes adds an exit hook that meets the other ranks (or ends the job) before
``MPI_Finalize``, which would wait for a lost peer for ever.  Both are listed in docs/accl.md ("What importing
accl does, and what the first group adds").
"""

from __future__ import annotations

import functools

from ..runtime.errors import EngineUnavailableError
from ..runtime.mpi_info import cuda_aware_query
from . import core
from .backend import create_process_group, register
from .group import ProcessGroupACCL
from .options import AcclOptions

__all__ = ["AcclOptions", "ProcessGroupACCL", "AcclWork", "EngineUnavailableError", "mpi_cuda_aware",
           "create_process_group", "register", "dump_flight_record"]


@functools.cache
def mpi_cuda_aware() -> bool:
    """Whether the MPI library takes CUDA device pointers (:func:`torchhpc.runtime.mpi_info.cuda_aware_query`;
    ``TORCHHPC_CUDA_AWARE_MPI=0/1`` overrides).  Reported only: accl stages device tensors through pinned host
    memory whatever it answers."""
    return cuda_aware_query().supported is True


def dump_flight_record() -> str:
    """Write this process's record of accl calls now, in torch's flight-recorder format, to
    ``$TORCH_FR_DUMP_TEMP_FILE<global rank>`` where that directory is this user's alone, else (and by default)
    ``$TMPDIR/torchhpc-<uid>/flight/nccl_trace_rank_<rank>``, in this user's 0700 directory; returns the file.

    accl also writes it by itself when a call times out, a peer dies or the ranks' calls differ; read every
    rank's file with ``torchhpc frtrace DIR``.  ``TORCH_FR_BUFFER_SIZE`` (default 2000 calls; 0: off) sizes it."""
    import torch.distributed as dist

    return core.load_backend().dump_flight_record(dist.get_rank() if dist.is_initialized() else 0)


def __getattr__(name: str) -> object:
    """``AcclWork`` (the C++ backend's ``Work``), from the built module when first asked for: ``import
    torchhpc.accl`` works before the backend is built (``make env`` imports the build helper first)."""
    if name == "AcclWork":
        return core.load_backend().AcclWork
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register()
