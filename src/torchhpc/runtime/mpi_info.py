"""Facts about the MPI library mpi4py is linked to: which one, thread level, CUDA-awareness.

CUDA-awareness is asked of the library itself (``MPIX_Query_cuda_support`` in Open MPI and MPICH >= 4,
``MPIX_GPU_query_support`` in MPICH >= 4), read from the runtime switch Cray-MPICH uses
(``MPICH_GPU_SUPPORT_ENABLED``), and, because a query can lie (built with CUDA, transport without it),
proved by :func:`cuda_aware_probe`: a real device-buffer send/recv between two ranks.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from . import settings

__all__ = ["CudaAwareness", "family_of_text", "library_version", "library_path", "thread_level", "cuda_aware_query",
           "cuda_aware_probe", "fault_tolerance", "release_singleton_segment"]

MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's type id for CUDA in MPIX_GPU_query_support


@dataclass(frozen=True)
class CudaAwareness:
    """Whether the MPI takes CUDA device pointers (``None``: it cannot say) and how that was found out."""

    supported: bool | None
    source: str


def family_of_text(text: str) -> str | None:
    """``openmpi`` or ``mpich`` (MPICH and its derivatives: Cray MPICH, Intel MPI, MVAPICH) from what a library
    or its launcher says of itself (``MPI_Get_library_version``, ``mpiexec --version``); None for neither.  The
    one reading of such text; a build asks ``mpi.h`` instead (:func:`torchhpc.accl.corebuild.family_of`)."""
    t = text.lower()
    if any(name in t for name in ("open mpi", "openrte", "prte")):
        return "openmpi"
    if any(name in t for name in ("mpich", "hydra", "intel(r) mpi", "mvapich")):
        return "mpich"
    return None


def library_version() -> str:
    """First line of ``MPI_Get_library_version`` (e.g. ``Open MPI v5.0.11, ...``)."""
    from mpi4py import MPI

    return MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].strip()


def thread_level() -> str:
    """The thread support MPI granted: ``single``, ``funneled``, ``serialized`` or ``multiple``."""
    from mpi4py import MPI

    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    return names.get(MPI.Query_thread(), "unknown")


def fault_tolerance() -> tuple[bool, bool]:
    """(the library has ULFM's ``MPIX_Comm_revoke``, this job was launched with it switched on): only then
    do survivors of a dead rank get MPI errors (``torchhpc.runtime.errors.PeerFailedError``) instead of being
    killed by the launcher."""
    from mpi4py import MPI  # noqa: F401  (loads the library)

    path = library_path()
    try:
        capable = path is not None and hasattr(ctypes.CDLL(path), "MPIX_Comm_revoke")
    except OSError:
        capable = False
    enabled = os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes")  # noqa: SIM112
    return capable, capable and enabled


def library_path() -> str | None:
    """Path of the shared MPI library loaded into this process (after ``import mpi4py.MPI``)."""
    from mpi4py import MPI  # noqa: F401  (loads the library)

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    for key in ("libmpi.so", "libmpi_", "libmpich", "libmpi"):
        for path in sorted(paths):
            if key in os.path.basename(path):
                return path
    return None


def cuda_aware_query() -> CudaAwareness:
    """Ask the MPI library (and Cray-MPICH's runtime switch) whether it is CUDA-aware.

    ``TORCHHPC_CUDA_AWARE_MPI=1`` / ``0`` overrides the answer, for MPIs that cannot be asked or answer wrong.
    """
    forced = settings.get("TORCHHPC_CUDA_AWARE_MPI")
    if forced is not None:
        return CudaAwareness(forced, f"TORCHHPC_CUDA_AWARE_MPI={os.environ['TORCHHPC_CUDA_AWARE_MPI'].strip()}")
    path = library_path()
    lib = None
    if path:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            lib = None
    if lib is not None and hasattr(lib, "MPIX_GPU_query_support"):
        flag = ctypes.c_int(0)
        if lib.MPIX_GPU_query_support(ctypes.c_int(MPIX_GPU_SUPPORT_CUDA), ctypes.byref(flag)) == 0:
            return CudaAwareness(bool(flag.value), "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)")
    if lib is not None and hasattr(lib, "MPIX_Query_cuda_support"):
        return CudaAwareness(bool(lib.MPIX_Query_cuda_support()), "MPIX_Query_cuda_support()")
    if "CRAY MPICH" in library_version().upper():
        enabled = os.environ.get("MPICH_GPU_SUPPORT_ENABLED") == "1"
        return CudaAwareness(enabled, f"MPICH_GPU_SUPPORT_ENABLED={os.environ.get('MPICH_GPU_SUPPORT_ENABLED', '')}")
    return CudaAwareness(None, "this MPI offers no query")


def cuda_aware_probe(comm=None, nbytes: int = 1 << 20) -> CudaAwareness:
    """Send a CUDA buffer from rank 0 to rank 1 and check it arrived; collective over ``comm``.

    Needs GPUs and at least two ranks (else ``supported=None``).  An MPI that is not CUDA-aware may crash
    here rather than fail cleanly: that crash is the answer, and is why this probe is explicit, not implicit.
    """
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    if comm.Get_size() < 2:
        return CudaAwareness(None, "probe needs >= 2 ranks")
    have_gpu = torch.cuda.is_available()
    if not all(comm.allgather(have_gpu)):
        return CudaAwareness(None, "probe needs a GPU on every rank")
    rank = comm.Get_rank()
    n = nbytes // 4
    ok = True
    if rank in (0, 1):
        buf = (torch.arange(n, dtype=torch.float32, device="cuda") if rank == 0
               else torch.zeros(n, dtype=torch.float32, device="cuda"))
        torch.cuda.synchronize()
        if rank == 0:
            comm.Send([buf, MPI.FLOAT], dest=1, tag=7301)
        else:
            comm.Recv([buf, MPI.FLOAT], source=0, tag=7301)
            ok = bool(torch.equal(buf.cpu(), torch.arange(n, dtype=torch.float32)))
    ok = comm.bcast(ok, root=1)
    return CudaAwareness(ok, f"device-buffer Send/Recv of {nbytes} B between ranks 0 and 1")


def release_singleton_segment() -> list[str]:
    """Unlink the shared-memory segment Open MPI 5 maps in a process run without ``mpiexec`` (a singleton): it
    never removes it, after a normal exit or a kill (open-mpi/ompi#13261), and every run left 16 MiB in
    ``/dev/shm``.  A singleton has no local peer to attach by name, so the name goes once mapped (the memory stays
    until the process ends); the paths removed.  Does nothing under a launcher, or before MPI is initialised."""
    import sys

    from .world import mpi_launcher

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or mpi_launcher() is not None or not mpi.Is_initialized() or mpi.COMM_WORLD.Get_size() != 1:
        return []
    removed = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "/sm_segment." in line and line.rstrip().endswith(".0")}
    except OSError:
        return []
    for path in sorted(paths):
        try:
            if os.stat(path).st_uid == os.geteuid():
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed
