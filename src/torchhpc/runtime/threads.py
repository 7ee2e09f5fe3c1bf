"""One thread budget per rank under every launcher: the cores this rank may use, shared among the ranks of its node.

Launchers disagree about threads, by accident.  torch's CPU wheel sizes its OpenMP pool with MKL, which gives one
thread to a process it sees started by an MPI launcher (Open MPI's ``OMPI_COMM_WORLD_*`` variables) and one per
physical core otherwise: under ``mpiexec`` every rank runs one thread, even alone on a 64-core node; under ``srun
--mpi=pmix`` (no such variables before ``MPI_Init``) every rank runs one per core of the node, so N ranks start N x
cores busy-waiting threads (the class-incremental rehearsal example ran 14x slower that way on 2 cores).  torchrun
sets ``OMP_NUM_THREADS=1`` itself when it starts several ranks.  torchhpc gives every rank one rule instead: one
thread per physical core this rank may use; ranks that share their cores (no binding) split them, at least one
thread each.  ``OMP_NUM_THREADS`` set by the user (or torchrun) wins, and so does ``torch.set_num_threads`` called
after ``import torchhpc``; PBS's default (``OMP_NUM_THREADS`` = the chunk's ``ncpus`` when the job asks for no
``ompthreads``, inherited by every MPI process of the chunk) does not.  Without a launcher nothing changes.

Where the job layer planned the node (``TORCHHPC_CPU_MAP``, ``TORCHHPC_GPU_MAP``: each local rank's cores and GPU
from the node's topology, :mod:`.topology`), a rank the launcher left unbound binds itself to its cores and takes
its GPU as ``CUDA_VISIBLE_DEVICES``.  With ``TORCHHPC_BIND=1``, a rank the launcher left on every core of a node it
shares with other ranks (``mpiexec --bind-to none``, MPICH's Hydra, ``srun --cpu-bind=none``, torchrun) binds
itself first to its own share of the node's physical cores, the local rank's block, as the launcher's binding flags
would have; a rank the launcher bound is left where it is.  Not by default: where jobs share a node without the
scheduler confining each to its own cores (no cgroups), every job's local rank 0 would take the same block, and
their helper threads with it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from . import settings
from .settings import SettingError

__all__ = ["ThreadBudget", "thread_budget", "set_default", "bind_share"]

MARKER = "TORCHHPC_THREADS"  # the budget torchhpc applied to this process, for doctor and child processes


@dataclass(frozen=True)
class ThreadBudget:
    """A rank's intra-op thread budget and the facts it comes from."""

    threads: int     # torch's intra-op threads for this rank
    cpus: int        # physical cores in this process's affinity mask
    node_cpus: int   # physical cores of the node
    local_size: int  # ranks on this node as the launcher says (1 when no launcher)
    launcher: str    # the launcher the facts come from (torchhpc.launcher.world_info), or "single"
    reason: str      # why this many
    user_set: bool = False  # OMP_NUM_THREADS chosen by the user or the launcher: kept as it is

    def describe(self) -> str:
        """One line for ``torchhpc doctor``."""
        return (f"{self.threads} thread(s) per rank: {self.reason} ({self.cpus} of the node's {self.node_cpus} "
                f"cores usable, {self.local_size} rank(s) on this node, launcher {self.launcher})")


def _core_of(cpu: int) -> tuple[str, str]:
    """(package, core) of logical CPU ``cpu`` from sysfs' topology; the CPU itself where there is none."""
    top = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(top + "physical_package_id") as pkg, open(top + "core_id") as core:
            return pkg.read().strip(), core.read().strip()
    except OSError:  # no topology (not Linux, or hidden): a logical CPU is a core
        return "cpu", str(cpu)


def _cores(cpus: set[int] | range) -> int:
    """Physical cores among logical ``cpus``: the hyperthreads of one core count once."""
    return max(1, len({_core_of(cpu) for cpu in cpus}))


def _cpus() -> int:
    """Physical cores this process may run on."""
    try:
        return _cores(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return _node_cpus()


def _node_cpus() -> int:
    """Physical cores of the node."""
    return _cores(range(os.cpu_count() or 1))


def _pbs_default(env: Mapping[str, str], value: str) -> bool:
    """Whether ``OMP_NUM_THREADS`` is PBS's own default, the chunk's ``ncpus`` (PBS sets it so when the job asks
    for no ``ompthreads``), which every MPI process of the chunk inherits: 2 ranks of ``select=...:ncpus=2:
    mpiprocs=2`` would each run 2 threads on 2 cores."""
    return "PBS_JOBID" in env and env.get("NCPUS", "").strip() == value


def _launch(env: Mapping[str, str]) -> tuple[int, str, int]:
    """(ranks on this node, launcher, local rank) from the launcher's variables; (1, "single", 0) without one."""
    from .errors import LauncherError
    from .world import world_info

    try:  # a copy: world_info may ask MPI about os.environ itself, and this must not start MPI
        info = world_info(dict(env), use_mpi=False)
    except LauncherError:
        return 1, "unreadable", 0
    return max(1, info.local_size), info.launcher, info.local_rank


def thread_budget(env: Mapping[str, str] | None = None) -> ThreadBudget:
    """The budget for this process from ``env`` (default: ``os.environ``) and its CPU affinity; MPI-free."""
    env = os.environ if env is None else env
    local, launcher, _ = _launch(env)
    return _budget(env, local, launcher)


def bind_share(local: int, local_rank: int, cpu_map: str = "") -> list[int] | None:
    """Bind this process to its CPUs in ``cpu_map`` (``TORCHHPC_CPU_MAP``: each local rank's cpulist, ranks apart by
    ":", the job layer's plan from the node's topology), else to the ``local_rank``-th of ``local`` equal blocks of
    the node's physical cores (each core with its hyperthreads), when its mask is the whole node; the CPUs bound
    to, or None where it was bound already, the cores are fewer than the ranks, or the platform cannot say."""
    try:
        mask = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    if local <= 1 or len(mask) < (os.cpu_count() or 1):
        return None
    mine = _mapped(cpu_map, local_rank) if cpu_map else _block(mask, local, local_rank)
    if not mine:
        return None
    try:  # every thread the process has so far (an MPI library's, torch's pools): later ones inherit
        tasks = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tasks = [0]
    for task in tasks:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(task, mine)
    return mine


def _mapped(cpu_map: str, local_rank: int) -> list[int]:
    """This local rank's CPUs in ``TORCHHPC_CPU_MAP``."""
    from .topology import cpulist  # here: `python -m torchhpc.runtime.topology` imports torchhpc first

    sets = cpu_map.split(":")
    try:
        return cpulist(sets[local_rank % len(sets)])
    except ValueError:
        raise SettingError(f"TORCHHPC_CPU_MAP={cpu_map!r}: each local rank's cpulist (0-3,8), ranks apart by ':' "
                           "(the job layer writes it from the node's topology)") from None


def _block(mask: set[int], local: int, local_rank: int) -> list[int]:
    """The ``local_rank``-th of ``local`` equal blocks of the physical cores in ``mask`` (each core with its
    hyperthreads); none where the cores are fewer than the ranks."""
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(mask):
        cores.setdefault(_core_of(cpu), []).append(cpu)
    per = len(cores) // local
    return [cpu for block in list(cores.values())[local_rank * per:(local_rank + 1) * per] for cpu in block]


def _budget(env: Mapping[str, str], local: int, launcher: str) -> ThreadBudget:
    cpus, node = _cpus(), _node_cpus()
    user = env.get("OMP_NUM_THREADS", "").strip()
    if user and env.get(MARKER) != user and not _pbs_default(env, user):
        threads = int(user) if user.isdigit() and int(user) > 0 else cpus
        return ThreadBudget(threads, cpus, node, local, launcher, "OMP_NUM_THREADS set by the user or launcher",
                            user_set=True)
    if cpus * local <= node:
        return ThreadBudget(cpus, cpus, node, local, launcher, "one per core this rank may use (no other rank "
                            "shares them)" if local > 1 else "one per core of the process")
    threads = max(1, cpus // local)
    return ThreadBudget(threads, cpus, node, local, launcher, f"{cpus} shared cores split among {local} ranks")


def set_default(env: dict[str, str] | None = None) -> ThreadBudget | None:
    """Apply the budget of a process a launcher started: ``OMP_NUM_THREADS`` (and the marker) in ``env``, which
    torch reads when it is imported, and ``torch.set_num_threads`` where torch is imported already; with
    ``TORCHHPC_BIND=1`` or ``TORCHHPC_CPU_MAP`` this process (``env`` None) is first bound to its share of the
    node's cores (that map's, the job layer's plan) if the launcher left it on all of them, and ``TORCHHPC_GPU_MAP``
    gives it its GPU as ``CUDA_VISIBLE_DEVICES`` where the launcher set none.  Nothing without a launcher or where
    the user set ``OMP_NUM_THREADS``.  Returns the budget applied, or None."""
    target = os.environ if env is None else env
    local, launcher, local_rank = _launch(target)
    if launcher in ("single", "unreadable"):  # a plain process: torch's default (and no sysfs reads)
        return None
    cpu_map = target.get("TORCHHPC_CPU_MAP", "")
    if env is None and local_rank < local and (cpu_map or settings.get("TORCHHPC_BIND", target)):
        bind_share(local, local_rank, cpu_map)
    gpus = target.get("TORCHHPC_GPU_MAP", "").split(",")
    if gpus != [""] and "CUDA_VISIBLE_DEVICES" not in target:  # the launcher had no GPU words (srun sets it)
        target["CUDA_VISIBLE_DEVICES"] = gpus[local_rank % len(gpus)]
    budget = _budget(target, local, launcher)
    if budget.user_set:
        return None
    target["OMP_NUM_THREADS"] = target[MARKER] = str(budget.threads)
    torch = sys.modules.get("torch") if env is None else None
    if torch is not None and torch.get_num_threads() != budget.threads:
        torch.set_num_threads(budget.threads)
    return budget
