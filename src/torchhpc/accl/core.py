"""Loads accl's C++ backend (``csrc/``, built by :mod:`.corebuild`) for the MPI library mpi4py has loaded.

The module is built per MPI family, as mpi4py's are; :func:`load_backend` picks the one whose family matches
``MPI.Get_library_version()`` and checks that it links that same library and was built for the running torch.
"""

from __future__ import annotations

import functools
import importlib
import os
import tempfile
import warnings
from pathlib import Path
from types import ModuleType

import torch
from mpi4py import MPI

from ..runtime import private
from ..runtime.errors import EngineUnavailableError
from ..runtime.mpi_info import family_of_text, release_singleton_segment

__all__ = ["load_backend", "family", "flight_prefix"]


def family(version: str | None = None) -> str | None:
    """``openmpi`` or ``mpich`` for an MPI library version string (default: the loaded library's)."""
    return family_of_text(version if version is not None else MPI.Get_library_version())


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
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = flight_prefix()  # before any dump: torch's writer reads it once
    release_singleton_segment()  # run without mpiexec: Open MPI 5 would leave 16 MiB in /dev/shm
    return mod


def flight_prefix() -> str:
    """Where flight-record dumps go (+ the global rank): ``$TORCH_FR_DUMP_TEMP_FILE`` when its directory is this
    user's and no one else can write it, else ``$TMPDIR/torchhpc-<uid>/flight/nccl_trace_rank_`` (0700).  torch's
    own default is a fixed name in the shared ``/tmp``, and its writer follows a symlink planted there."""
    given = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if given:
        try:
            Path(given).parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # as torch's writer would, private
            private.check_trusted(Path(given).parent)
            return given
        except (OSError, private.UnsafePathError) as exc:
            warnings.warn(f"accl: not writing flight records to TORCH_FR_DUMP_TEMP_FILE={given}: {exc}",
                          stacklevel=2)
    try:
        folder = private.runtime_dir("flight")
    except private.UnsafePathError as exc:  # someone else holds the name: a directory of our own, say where
        folder = Path(tempfile.mkdtemp(prefix="torchhpc-flight-"))
        warnings.warn(f"accl: {exc}; flight records go to {folder} instead", stacklevel=2)
    return str(folder / "nccl_trace_rank_")
