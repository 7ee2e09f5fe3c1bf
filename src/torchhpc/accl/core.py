"""Loads accl's C++ backend (``csrc/``, built by :mod:`.corebuild`) for the MPI library mpi4py has loaded.

The module is built per MPI family, as mpi4py's are; :func:`load_backend` picks the one whose family matches
``MPI.Get_library_version()`` and checks that it links that same library and was built for the running torch.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch
from mpi4py import MPI

from ..errors import EngineUnavailableError

__all__ = ["load_backend", "family"]


def family(version: str | None = None) -> str | None:
    """``openmpi`` or ``mpich`` for an MPI library version string (default: the loaded library's)."""
    v = (version if version is not None else MPI.Get_library_version()).upper()
    if "OPEN MPI" in v:
        return "openmpi"
    if any(name in v for name in ("MPICH", "INTEL(R) MPI", "MVAPICH")):
        return "mpich"
    return None


def _first_line(text: str) -> str:
    return text.replace("\x00", "").strip().splitlines()[0].strip() if text.strip() else ""


@functools.cache
def load_backend() -> ModuleType:
    """The C++ backend for the loaded MPI and the running torch; :class:`EngineUnavailableError` saying how to
    build it when it is missing or built for another library or torch."""
    fam = family()
    build = f"`make env`, or `python -m torchhpc.accl.corebuild --mpicc <the {fam} mpicc>`"
    if fam is None:
        raise EngineUnavailableError(
            f"accl: no C++ backend for this MPI library ({_first_line(MPI.Get_library_version())}): "
            "accl supports Open MPI and MPICH-derived libraries")
    try:
        mod = importlib.import_module(f"{__package__}._backend_{fam}")
    except ImportError as exc:
        raise EngineUnavailableError(f"accl: the C++ backend for {fam} is not built ({exc}). Build it with "
                                     f"{build}") from None
    mine, loaded = _first_line(mod.library_version()), _first_line(MPI.Get_library_version())
    if mine != loaded:
        raise EngineUnavailableError(f"accl: the C++ backend links '{mine}' but mpi4py loaded '{loaded}'; rebuild "
                                     f"it with {build} --force")
    if mod.torch_version != torch.__version__:
        raise EngineUnavailableError(f"accl: the C++ backend was built for torch {mod.torch_version}, running "
                                     f"{torch.__version__}; rebuild it with {build} --force")
    return mod
