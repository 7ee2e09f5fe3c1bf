"""What the ``accl`` backend will do on this machine, for ``torchhpc doctor`` and bug reports."""

from __future__ import annotations

import importlib.util

import torch

from ..errors import EngineUnavailableError
from . import backend, core
from .mpi_engine import mpi_cuda_aware

__all__ = ["environment_report"]


def environment_report() -> list[tuple[str, str]]:
    """(item, finding) pairs: MPI library, CUDA tensor path (direct or staged), the C++ front in use, ACCL
    engine availability."""
    from mpi4py import MPI

    lib = MPI.Get_library_version().strip().replace("\x00", "").splitlines()[0]
    aware = mpi_cuda_aware()
    if aware:
        cuda = "CUDA tensors go to MPI directly (the MPI library reports CUDA support)"
    else:
        cuda = "CUDA tensors are staged through pinned host memory (MPI is not CUDA-aware)"
    if not torch.cuda.is_available():
        cuda += "; no CUDA device visible"
    has_pyaccl = importlib.util.find_spec("pyaccl") is not None
    accl = ("pyaccl installed: engine='accl' usable with TORCHHPC_ACCL_SIM_SOCK or TORCHHPC_ACCL_XCLBIN"
            if has_pyaccl else "pyaccl not installed: only the MPI engine is available")
    front = core.front_status()[1]
    return [("accl MPI library", lib), ("accl CUDA path", cuda), ("accl C++ front", front),
            ("accl ACCL engine", accl), ("accl implementation", _implementation())]


def _implementation() -> str:
    """Which implementation serves "accl" (``TORCHHPC_ACCL_IMPL``) and whether the C++ backend is built."""
    try:
        mod = core.load_backend()
        built = f"C++ backend {mod.__name__.rsplit('.', 1)[-1]} built for torch {mod.torch_version}"
    except EngineUnavailableError as exc:
        built = f"C++ backend unusable: {exc}"
    if backend.IMPL == "cpp":
        return f"C++ backend (TORCHHPC_ACCL_IMPL=cpp): {built}"
    return f"Python adapter (TORCHHPC_ACCL_IMPL=py, the default); {built}"
