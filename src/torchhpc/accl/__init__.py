"""``torchhpc.accl``: a complete torch.distributed backend ``"accl"`` over MPI (mpi4py) or ACCL.

Importing this package registers the backend::

    import torch.distributed as dist
    import torchhpc.accl  # noqa: F401  (registers "accl")

    dist.init_process_group("accl")  # under mpiexec: no MASTER_ADDR/MASTER_PORT needed

Every call runs in one C++ class, ``ProcessGroupACCL`` (a ``c10d::Backend``, ``csrc/``); this package registers
it, holds its options (:class:`AcclOptions`) and reports the environment it will run in.
"""

from __future__ import annotations

from ..errors import EngineUnavailableError, MismatchError, PeerFailedError, PeerTimeoutError
from . import core
from .backend import create_process_group, register
from .group import ProcessGroupACCL
from .info import environment_report, mpi_cuda_aware
from .options import AcclOptions

#: the errors of accl's calls under their accl names (one family: :mod:`torchhpc.errors`)
AcclMismatchError = MismatchError
AcclTimeoutError = PeerTimeoutError
AcclPeerFailedError = PeerFailedError

__all__ = [
    "AcclOptions", "ProcessGroupACCL", "AcclWork", "AcclMismatchError", "AcclTimeoutError",
    "AcclPeerFailedError", "EngineUnavailableError", "mpi_cuda_aware",
    "create_process_group", "register", "environment_report", "dump_flight_record",
]


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
