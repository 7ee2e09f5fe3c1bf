"""``torchhpc.accl``: a complete torch.distributed backend ``"accl"`` over MPI (mpi4py) or ACCL.

Importing this package registers the backend::

    import torch.distributed as dist
    import torchhpc.accl  # noqa: F401  (registers "accl")

    dist.init_process_group("accl")  # under mpiexec: no MASTER_ADDR/MASTER_PORT needed

See :class:`AcclOptions` for the engine (``mpi``/``accl``), segmentation and checks.
"""

from __future__ import annotations

from . import backend
from .backend import ProcessGroupACCL, create_process_group, register
from .engine import CollectiveEngine, EngineUnavailableError, Request
from .info import environment_report
from .mpi_engine import MpiEngine, mpi_cuda_aware
from .options import AcclOptions
from .work import AcclMismatchError, AcclPeerFailedError, AcclTimeoutError, AcclWork

if backend.IMPL == "cpp":
    from .group import AcclWork  # noqa: F811 - the C++ backend's Work

__all__ = [
    "AcclOptions", "ProcessGroupACCL", "AcclWork", "AcclMismatchError", "AcclTimeoutError",
    "AcclPeerFailedError", "CollectiveEngine", "Request", "MpiEngine", "EngineUnavailableError",
    "mpi_cuda_aware",
    "create_process_group", "register", "environment_report",
]

register()
