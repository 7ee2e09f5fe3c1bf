"""``torchhpc.mpi_upstream``: PyTorch's own MPI backend, built from upstream's ``ProcessGroupMPI.cpp`` with our
patches against the installed torch (``make mpi-backend``), without a PyTorch source build.

Importing this package registers it with torch.distributed as ``"mpi_upstream"`` (CPU, and CUDA where torch
has it: a CUDA tensor on an MPI that is not CUDA-aware raises the patched check's error)::

    import torchhpc.mpi_upstream as mpi_upstream

    mpi_upstream.init_process_group()          # under mpiexec: world from MPI, no rendezvous
    # or give torch's own name to it, as a PyTorch built with MPI has it:
    mpi_upstream.use_as_torch_mpi(); torch.distributed.init_process_group("mpi")

The module loaded is the one built for the MPI this process runs on (:func:`family`); upstream's code
initializes MPI itself (``MPI_Init_thread``, ``MPI_THREAD_SERIALIZED``) unless mpi4py or anyone else did first.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from ..runtime import settings
from ..runtime.mpi_info import family_of_text

__all__ = ["NAME", "family", "module_name", "load", "create_backend", "register", "init_process_group",
           "use_as_torch_mpi", "cuda_aware", "UnsupportedGroupError"]

NAME = "mpi_upstream"
FAMILIES = ("openmpi", "mpich")


def module_name(family: str) -> str:
    """The extension module built for MPI ``family`` (``_pg_mpi_openmpi``, ``_pg_mpi_mpich``)."""
    return f"_pg_mpi_{family}"


class UnsupportedGroupError(NotImplementedError):
    """A group upstream's backend cannot make under torch.distributed (a strict subset of the world)."""


def family() -> str:
    """The MPI family of this process: ``$TORCHHPC_MPI_FAMILY``; else the library mpi4py loaded, if it did;
    else the launcher's (:func:`torchhpc.launcher.mpi_launcher`) or ``$MPI4PY_LIBMPI``; else the only family
    built, else that of the ``mpiexec`` beside this interpreter."""
    forced = settings.get("TORCHHPC_MPI_FAMILY")
    if forced:
        return forced
    if "mpi4py.MPI" in sys.modules:
        fam = family_of_text(sys.modules["mpi4py.MPI"].Get_library_version())
        if fam is not None:
            return fam
    from ..runtime.world import mpi_launcher

    launcher = mpi_launcher()
    if launcher == "openmpi":
        return "openmpi"
    if launcher in ("mpich", "pals", "mvapich"):
        return "mpich"
    if "libmpi.so.12" in os.environ.get("MPI4PY_LIBMPI", ""):
        return "mpich"
    built = [f for f in FAMILIES if _module_file(f) is not None]
    if len(built) == 1:
        return built[0]
    from ..runtime.mpirun import mpi_flavor

    flavor = mpi_flavor()
    return flavor if flavor in FAMILIES else "openmpi"


def _module_file(fam: str) -> str | None:
    spec = importlib.util.find_spec(f"{__name__}.{module_name(fam)}")
    return spec.origin if spec is not None else None


@functools.cache
def load(fam: str | None = None) -> ModuleType:
    """The compiled backend for MPI family ``fam`` (default: :func:`family`); ImportError saying how to build it."""
    fam = fam or family()
    try:
        mod = importlib.import_module(f"{__name__}.{module_name(fam)}")
    except ImportError as exc:
        raise ImportError(f"mpi_upstream: PyTorch's MPI backend is not built for {fam} ({exc}); build it with "
                          f"`make mpi-backend` or `python -m torchhpc.mpi_upstream.build --mpicxx <the {fam} "
                          "mpicxx>`") from None
    if mod.torch_version != torch.__version__:
        raise ImportError(f"mpi_upstream: the {fam} module was built for torch {mod.torch_version}, this is "
                          f"torch {torch.__version__}; rebuild it with `make mpi-backend`")
    return mod


def cuda_aware() -> bool:
    """The patched upstream check: whether this MPI accepts CUDA device buffers (call after MPI is initialized)."""
    return bool(load().cuda_aware())


def create_backend(ranks: list[int] | None = None) -> Any:
    """Upstream's ``ProcessGroupMPI::createProcessGroupMPI(ranks)`` (every world rank must call it): a c10d
    ``Backend`` over ``MPI_COMM_WORLD`` (``ranks`` empty) or over ``ranks``; None on processes outside them."""
    return load().create(list(ranks or []))


def _world_size() -> int:
    pg = create_backend()  # initializes MPI once; a world group costs no communication
    return pg.size()


def _check(pg: Any, want_rank: int, want_size: int, what: str) -> Any:
    if pg is None or pg.rank() != want_rank or pg.size() != want_size:
        got = "no group" if pg is None else f"rank {pg.rank()} of {pg.size()}"
        raise ValueError(f"mpi_upstream: torch expects {what} rank {want_rank} of {want_size}, MPI gives {got}: "
                         "the ranks given to torch must be MPI_COMM_WORLD's")
    return pg


def _refuse_strict_subset(ranks: list[int]) -> None:
    """Raise :class:`UnsupportedGroupError` when ``ranks`` is not every world rank (see its message)."""
    size = _world_size()
    if sorted(ranks) != list(range(size)):
        raise UnsupportedGroupError(
            f"mpi_upstream: group {ranks} is a strict subset of the {size} world ranks. Upstream's "
            "ProcessGroupMPI makes a group with MPI_Comm_create over MPI_COMM_WORLD, a call every process must "
            "make, but torch.distributed calls a backend (also its own MPI one) only on the group's members, "
            "so the members would wait forever; use the accl backend (torchhpc.accl) for subgroups")


def _create(opts: Any, _backend_options: Any) -> Any:
    """torch's extended-API creator: the default group over MPI_COMM_WORLD, a group of every world rank over
    a communicator upstream makes with MPI_Comm_create; a strict subset is refused."""
    ranks = list(opts.global_ranks_in_group)
    if not ranks:
        return _check(create_backend(), opts.group_rank, opts.group_size, "the default group's")
    _refuse_strict_subset(ranks)
    return _check(create_backend(ranks), opts.group_rank, opts.group_size, f"group {ranks}'s")


def register() -> None:
    """Register ``"mpi_upstream"`` with torch.distributed (idempotent); nothing is loaded or initialized yet."""
    if NAME.upper() in dist.Backend._plugins:
        return
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=devices)


def init_process_group(timeout: timedelta | None = None, **kwargs: Any) -> None:
    """``dist.init_process_group("mpi_upstream")`` with rank and world size from MPI and a process-local store
    (as torch does for its MPI backend: nothing needs a rendezvous)."""
    pg = create_backend()
    kwargs.setdefault("store", dist.HashStore())
    dist.init_process_group(NAME, rank=pg.rank(), world_size=pg.size(), timeout=timeout, **kwargs)


class _TorchSlot:
    """Stands in for torch's ``ProcessGroupMPI`` class where a PyTorch build with MPI has it."""

    @staticmethod
    def create(ranks: list[int]) -> Any:
        """What torch's ``ProcessGroupMPI.create`` does; a strict subset of the world is refused."""
        if ranks:
            _refuse_strict_subset(ranks)
        return create_backend(ranks)


def use_as_torch_mpi() -> None:
    """Make torch's own name ``"mpi"`` (``Backend.MPI``, ``dist.is_mpi_available()``) use this build, as in a
    PyTorch built with MPI: ``init_process_group("mpi")`` takes rank and world size from MPI, with no store."""
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    if not hasattr(c10d, "_MPI_AVAILABLE") or "_new_process_group_helper" not in vars(c10d):
        raise RuntimeError(f"mpi_upstream: torch {torch.__version__} has no MPI slot this module knows how to fill")
    load()  # fail now, not at init_process_group, when the backend is not built
    c10d._MPI_AVAILABLE = True
    c10d.ProcessGroupMPI = _TorchSlot


register()
