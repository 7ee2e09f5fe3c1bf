"""Loads accl's compiled core for the MPI library mpi4py has loaded (built by :mod:`.corebuild`).

The core (``_core.c``) carries the header exchange and the MPI engine's collective calls; its module is
built per MPI family, as mpi4py's are, and this module picks the one whose family matches
``MPI.Get_library_version()``, checks that both name the same library, and gives it the Python objects
it raises or calls (MPI's exception, the mismatch error, the inline-timeout signal, the call describer).

The front (``_front.cpp``, one build per torch) reads torch's calls in C++ for the core; :func:`load_front`
loads it when it was built for the running torch, else says why not (:func:`front_status`).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from types import ModuleType

import torch
from mpi4py import MPI

from ..errors import EngineUnavailableError, MismatchError
from . import wire

__all__ = ["load", "load_front", "front_status", "family", "Expired", "describe_call"]


class Expired(Exception):
    """An inline wait passed the group timeout (the executor turns it into the group's abort)."""


def family(version: str | None = None) -> str | None:
    """``openmpi`` or ``mpich`` for an MPI library version string (default: the loaded library's)."""
    v = (version if version is not None else MPI.Get_library_version()).upper()
    if "OPEN MPI" in v:
        return "openmpi"
    if any(name in v for name in ("MPICH", "INTEL(R) MPI", "MVAPICH")):
        return "mpich"
    return None


def describe_call(kind: int, dtype: int, op: int, root: int, nbytes: int, numel: int, extra: int,
                  seq: int) -> str:
    """A compiled call in words for errors, e.g. ``all_reduce(float32, 4 elements, SUM) as call #3``."""
    return wire.describe(wire.Header(wire.MAGIC, kind, seq, dtype, op, root, nbytes, numel, extra))


def _first_line(text: str) -> str:
    return text.replace("\x00", "").strip().splitlines()[0].strip() if text.strip() else ""


@functools.cache
def load() -> ModuleType:
    """The core module for the loaded MPI, with its hooks set; :class:`EngineUnavailableError` saying how
    to build it when it is missing or built for another library."""
    fam = family()
    if fam is None:
        raise EngineUnavailableError(
            f"accl: no compiled core for this MPI library ({_first_line(MPI.Get_library_version())}): "
            "accl's MPI engine supports Open MPI and MPICH-derived libraries")
    try:
        mod = importlib.import_module(f"{__package__}._core_{fam}")
    except ImportError as exc:
        raise EngineUnavailableError(
            f"accl: the compiled core for {fam} is not built ({exc}). Build it with `make env`, or "
            f"`python -m torchhpc.accl.corebuild --mpicc <the {fam} mpicc>`") from None
    mine, loaded = _first_line(mod.library_version()), _first_line(MPI.Get_library_version())
    if mine != loaded:
        raise EngineUnavailableError(
            f"accl: the compiled core links '{mine}' but mpi4py loaded '{loaded}'; rebuild it with "
            f"`python -m torchhpc.accl.corebuild --force --mpicc <that library's mpicc>`")
    mod.set_hooks(MPI.Exception, MismatchError, Expired, describe_call)
    return mod


@functools.cache
def front_status() -> tuple[ModuleType | None, str]:
    """The front module (or None) and a line saying which torch it serves or why it is not used."""
    try:
        mod = importlib.import_module(f"{__package__}._front")
    except ImportError as exc:
        return None, (f"not built ({exc}); accl runs its Python adapter alone. Build it with `make env` or "
                      "`python -m torchhpc.accl.corebuild --front only`")
    if mod.torch_version != torch.__version__:
        why = (f"built for torch {mod.torch_version}, running {torch.__version__}: not loaded. Rebuild it with "
               "`python -m torchhpc.accl.corebuild --front only --force`")
        warnings.warn(f"accl: the C++ front was {why}", RuntimeWarning, stacklevel=3)  # once: cached
        return None, why
    return mod, f"built for torch {mod.torch_version}"


def load_front() -> ModuleType | None:
    """The C++ front for the running torch, or None (see :func:`front_status`)."""
    return front_status()[0]


@functools.cache
def load_backend() -> ModuleType:
    """The C++ backend (``csrc/``, issue 24) for the loaded MPI and the running torch;
    :class:`EngineUnavailableError` saying how to build it when it is missing or built for another library or
    torch."""
    fam = family()
    build = f"`python -m torchhpc.accl.corebuild --backend only --mpicc <the {fam} mpicc>`"
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
