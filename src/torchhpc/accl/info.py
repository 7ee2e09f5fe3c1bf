"""What the ``accl`` backend will do on this machine, for ``torchhpc doctor`` and bug reports."""

from __future__ import annotations

import functools
import importlib.util

import torch

from ..errors import EngineUnavailableError
from ..mpi_info import cuda_aware_query
from . import core

__all__ = ["environment_report", "mpi_cuda_aware"]


@functools.cache
def mpi_cuda_aware() -> bool:
    """True when the MPI library can take CUDA device pointers (see :func:`torchhpc.mpi_info.cuda_aware_query`;
    ``TORCHHPC_CUDA_AWARE_MPI=0/1`` overrides)."""
    return cuda_aware_query().supported is True


def environment_report() -> list[tuple[str, str]]:
    """(item, finding) pairs: MPI library, the C++ backend in use, how CUDA tensors travel (always staged through
    pinned host memory; whether the MPI library is CUDA-aware is reported, and changes nothing yet), ACCL engine
    availability."""
    from mpi4py import MPI

    lib = MPI.Get_library_version().strip().replace("\x00", "").splitlines()[0]
    aware = "reports CUDA support" if mpi_cuda_aware() else "is not CUDA-aware"
    cuda = f"CUDA tensors are staged through pinned host memory (the MPI library {aware}; accl stages either way)"
    if not torch.cuda.is_available():
        cuda += "; no CUDA device visible"
    has_pyaccl = importlib.util.find_spec("pyaccl") is not None
    accl = ("pyaccl installed: engine='accl' usable with TORCHHPC_ACCL_SIM_SOCK or TORCHHPC_ACCL_XCLBIN"
            if has_pyaccl else "pyaccl not installed: only the MPI engine is available")
    try:
        mod = core.load_backend()
        backend = f"{mod.__name__.rsplit('.', 1)[-1]}, built for torch {mod.torch_version}"
    except EngineUnavailableError as exc:
        backend = f"unusable: {exc}"
    return [("accl MPI library", lib), ("accl C++ backend", backend), ("accl CUDA path", cuda),
            ("accl ACCL engine", accl)]
