"""Who am I in this job: rank, local rank and sizes under every launcher HPC users meet.

Launchers and the variables they set (the first that applies wins, in this order):

=============  ====================================================================
torchrun       ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (+ ``TORCHELASTIC_RUN_ID``)
Open MPI       ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``
Cray PALS      ``PALS_RANKID``, ``PALS_LOCAL_RANKID``, ``PMI_SIZE``, ``PMI_LOCAL_SIZE``
MPICH Hydra    ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``/``PMI_LOCAL_RANK``, ``MPI_LOCALNRANKS``
MVAPICH2       ``MV2_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``
Slurm (srun)   ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_NODEID``
mpi4py         no variables, MPI already initialised: ``COMM_WORLD`` and a shared-memory split
single         nothing: one process
=============  ====================================================================

Slurm variables are inherited by processes that ``mpiexec`` starts inside an allocation, so they are used only
when no MPI launcher's variables are present.  Contradictions (two launchers naming different ranks, ``RANK >=
WORLD_SIZE``, local rank >= local size, torchrun started under a multi-rank ``mpiexec``) raise
:class:`~torchhpc.runtime.errors.LauncherError`.  Any mapping of ranks to nodes is accepted: a local rank may exceed
the rank (``mpiexec --map-by node``, ``--rank-by``, Slurm's cyclic distribution, PALS).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace

from .errors import LauncherError, RemoteError

__all__ = ["WorldInfo", "world_info", "mpi_launcher", "MPI_LAUNCHER_VARS", "agree_on_master", "job_store",
           "job_rendezvous", "torchrun_store"]




@dataclass(frozen=True)
class WorldInfo:
    """This process's place in the job, and the launcher it was read from."""

    rank: int
    local_rank: int
    world_size: int
    local_size: int
    launcher: str

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


# launcher name -> (rank, size, local rank candidates, local size candidates)
_MPI_LAUNCHERS: tuple[tuple[str, str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    ("pals", "PALS_RANKID", "PMI_SIZE", ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"),
     ("PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE")),
    ("mpich", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
     ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")),
    ("mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
     ("MV2_COMM_WORLD_LOCAL_RANK",), ("MV2_COMM_WORLD_LOCAL_SIZE",)),
)


# Variables whose presence alone says an MPI launcher started this process (the rank variables above,
# plus PMIx and Hydra markers that appear even where the rank variables are named differently).
_MPI_MARKERS: tuple[tuple[str, str], ...] = (
    *((name, rank_var) for name, rank_var, _, _, _ in _MPI_LAUNCHERS),
    ("openmpi", "OMPI_COMM_WORLD_SIZE"), ("pmix", "PMIX_RANK"), ("mpich", "PMI_SIZE"),
    ("mpich", "MPI_LOCALNRANKS"), ("mpich", "HYDRA_CONTROL_FD"), ("mvapich", "MV2_COMM_WORLD_SIZE"),
)


MPI_LAUNCHER_VARS: tuple[str, ...] = tuple(dict.fromkeys(var for _, var in _MPI_MARKERS))
"""Every variable :func:`mpi_launcher` looks for (e.g. to clear them for a plain child process)."""


def mpi_launcher(env: Mapping[str, str] | None = None) -> str | None:
    """The MPI launcher that started this process (``openmpi``, ``pals``, ``mpich``, ``mvapich``, ``pmix``),
    or None.  The one launcher detector of the package (used by :func:`world_info` and accl's rendezvous)."""
    env = os.environ if env is None else env
    return next((name for name, var in _MPI_MARKERS if var in env), None)


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise LauncherError(f"{name}={raw!r} is not an integer") from None
    if value < 0:
        raise LauncherError(f"{name}={value} is negative")
    return value


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if name in env:
            return _int(env, name)
    return None


def _validated(info: WorldInfo, source: str) -> WorldInfo:
    if info.world_size < 1:
        raise LauncherError(f"{source}: world size is {info.world_size}; it must be >= 1")
    if info.rank >= info.world_size:
        raise LauncherError(f"{source}: rank {info.rank} >= world size {info.world_size}")
    if not 1 <= info.local_size <= info.world_size:
        raise LauncherError(f"{source}: local size {info.local_size} is not in [1, world size {info.world_size}]")
    if info.local_rank >= info.local_size:
        raise LauncherError(f"{source}: local rank {info.local_rank} >= local size {info.local_size}")
    # Nothing more: MPI promises no relation between rank and local rank (``--map-by node``, ``--rank-by``,
    # Slurm's cyclic and arbitrary distributions and PALS all give local rank > rank).
    return info


def _from_torchrun(env: Mapping[str, str]) -> WorldInfo | None:
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    missing = [n for n in ("RANK", "WORLD_SIZE") if n not in env]
    if missing:
        raise LauncherError(f"torchrun-style variables incomplete: {', '.join(missing)} not set")
    rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else None
    local_size = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else None
    if local_rank is None:
        local_rank, local_size = (rank, size) if size == 1 else (None, None)
    info = WorldInfo(rank, -1 if local_rank is None else local_rank, size,
                     -1 if local_size is None else local_size, "torchrun")
    return info


def _from_mpi_launchers(env: Mapping[str, str]) -> list[WorldInfo]:
    found = []
    for name, rank_var, size_var, lrank_vars, lsize_vars in _MPI_LAUNCHERS:
        if rank_var not in env:
            continue
        if size_var not in env:
            raise LauncherError(f"{name}: {rank_var} is set but {size_var} is not")
        lrank, lsize = _first(env, lrank_vars), _first(env, lsize_vars)
        found.append(WorldInfo(_int(env, rank_var), -1 if lrank is None else lrank, _int(env, size_var),
                               -1 if lsize is None else lsize, name))
    return found


def _slurm_tasks_on_node(spec: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from Slurm's compressed ``2(x3),1`` tasks-per-node syntax."""
    nodes: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise LauncherError(f"cannot parse Slurm tasks-per-node {spec!r}")
        nodes += [int(match.group(1))] * int(match.group(2) or 1)
    if node_id >= len(nodes):
        raise LauncherError(f"SLURM_NODEID={node_id} but tasks-per-node {spec!r} lists {len(nodes)} nodes")
    return nodes[node_id]


def _from_slurm(env: Mapping[str, str]) -> WorldInfo | None:
    # Only an srun step gives per-task variables; a batch script sees SLURM_PROCID=0 for the whole allocation.
    if "SLURM_PROCID" not in env or not ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return None
    rank = _int(env, "SLURM_PROCID")
    size = _int(env, "SLURM_NTASKS") if "SLURM_NTASKS" in env else _int(env, "SLURM_NPROCS")
    local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else -1
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node_id = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    local_size = _slurm_tasks_on_node(spec, node_id) if spec else -1
    return WorldInfo(rank, local_rank, size, local_size, "slurm")


def _mpi_initialized() -> bool:
    mod = sys.modules.get("mpi4py.MPI")
    return bool(mod is not None and mod.Is_initialized() and not mod.Is_finalized())


def _from_mpi4py() -> WorldInfo:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        return WorldInfo(world.Get_rank(), node.Get_rank(), world.Get_size(), node.Get_size(), "mpi4py")
    finally:
        node.Free()


def _check_mpi_launchers_agree(mpi: list[WorldInfo]) -> None:
    """Refuse two MPI launchers' variables naming different ranks (stale variables)."""
    for other in mpi[1:]:
        if (other.rank, other.world_size) != (mpi[0].rank, mpi[0].world_size):
            raise LauncherError(
                f"launchers disagree: {mpi[0].launcher} says rank {mpi[0].rank} of {mpi[0].world_size}, "
                f"{other.launcher} says rank {other.rank} of {other.world_size}; "
                "clear the stale variables or launch with one launcher"
            )


def _reconcile_torchrun(torchrun: WorldInfo, mpi: list[WorldInfo], env: Mapping[str, str]) -> list[WorldInfo]:
    """torchrun's variables beside an MPI launcher's: refuse contradictions; the MPI launchers that still count."""
    m = mpi[0]
    if "TORCHELASTIC_RUN_ID" in env and m.world_size > 1:
        raise LauncherError(
            f"torchrun is running under {m.launcher} mpiexec with {m.world_size} MPI ranks: every MPI rank "
            "started its own torchrun, giving independent jobs that will deadlock or clobber each other. "
            "Launch with `mpiexec -n N python train.py` or with `torchrun` alone, not both."
        )
    if "TORCHELASTIC_RUN_ID" in env:
        return []  # `mpiexec -n 1 torchrun ...`: torchrun's workers own the ranks
    if (torchrun.rank, torchrun.world_size) != (m.rank, m.world_size):
        raise LauncherError(
            f"RANK/WORLD_SIZE say rank {torchrun.rank} of {torchrun.world_size} but {m.launcher} says "
            f"rank {m.rank} of {m.world_size}; unset RANK/WORLD_SIZE or fix the launch"
        )
    return mpi


def _fill_local(info: WorldInfo, others: list[WorldInfo], ask_mpi: bool) -> WorldInfo:
    """Fill a local rank/size the first launcher left out from the other launchers, then from MPI."""
    for other in others:
        if info.local_rank < 0 and other.local_rank >= 0:
            info = replace(info, local_rank=other.local_rank)
        if info.local_size < 0 and other.local_size >= 0:
            info = replace(info, local_size=other.local_size)
    if info.local_rank >= 0 and info.local_size >= 0:
        return info
    if info.world_size == 1:
        return replace(info, local_rank=0, local_size=1)
    if not ask_mpi:
        raise LauncherError(
            f"{info.launcher}: local rank/size not in the environment and MPI not available to find them; "
            "set LOCAL_RANK and LOCAL_WORLD_SIZE"
        )
    local = _from_mpi4py()
    if (local.rank, local.world_size) != (info.rank, info.world_size):
        raise LauncherError(
            f"{info.launcher} says rank {info.rank} of {info.world_size} but MPI_COMM_WORLD is rank "
            f"{local.rank} of {local.world_size}"
        )
    return replace(info, local_rank=local.local_rank, local_size=local.local_size)


def world_info(env: Mapping[str, str] | None = None, *, use_mpi: bool | None = None) -> WorldInfo:
    """Return rank, local rank, world size, local size and the launcher detected from ``env``.

    ``use_mpi``: ask MPI (``COMM_WORLD`` and a shared-memory split) when the variables leave something out.
    ``None`` (default) asks it only if mpi4py has already initialised MPI, so plain scripts stay MPI-free.
    """
    env = os.environ if env is None else env
    if use_mpi is None:
        use_mpi = env is os.environ and _mpi_initialized()

    torchrun = _from_torchrun(env)
    mpi = _from_mpi_launchers(env)
    _check_mpi_launchers_agree(mpi)
    if torchrun is not None and mpi:
        mpi = _reconcile_torchrun(torchrun, mpi, env)

    candidates = ([torchrun] if torchrun else []) + mpi
    info = candidates[0] if candidates else _from_slurm(env)
    if info is None:
        if use_mpi:
            return _validated(_from_mpi4py(), "mpi4py")
        return WorldInfo(0, 0, 1, 1, "single")
    info = _fill_local(info, candidates[1:], bool(use_mpi or (mpi and env is os.environ)))
    return _validated(info, info.launcher)


def _slurm_first_host(nodelist: str) -> str:
    """First host name of a Slurm node list such as ``nid[001-004,010],login1``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise LauncherError(f"cannot parse SLURM_JOB_NODELIST {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def job_store(host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta):
    """The job's rendezvous ``TCPStore`` at ``host:port``.  Rank 0 (``is_master``) serves it on ``host``'s address
    only (127.0.0.1 for a job on one node), not on every interface as torch's own server does: other users' jobs
    on the network reach it only where the job's own ranks must.  ``port`` 0 (master): a free one, no race."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0]
        if ipaddress.ip_address(address[0]).is_loopback and host not in ("127.0.0.1", "localhost"):
            address = ("", address[1])  # a host name this node maps to loopback (Debian's 127.0.1.1): others differ
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        raise LauncherError(f"rendezvous: cannot listen on {host}:{port} ({exc}); another process (or user) "
                            "may hold that port: set MASTER_PORT to a free one") from None
    port = sock.getsockname()[1]
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())  # the store owns the descriptor from here


def agree_on_master(world_size: int, timeout: float = 300.0, call: str = "init_distributed()"):
    """The job's rendezvous store, its address agreed through MPI (``COMM_WORLD``), the one MPI rendezvous of the
    package (:func:`init_distributed` and accl's ``env://``): rank 0 listens on a free port of its host (127.0.0.1
    when every rank is on its node) and broadcasts the address, or its error, which every rank then raises as a
    :class:`~torchhpc.runtime.errors.RemoteError`; every rank joins.  ``call`` names what every rank must have called.

    Fails with :class:`~torchhpc.runtime.errors.PeerTimeoutError` if some rank does not join within ``timeout`` seconds.
    """
    from mpi4py import MPI

    from .waiting import wait_requests  # (imports torch: this module's launch-variable half does not)

    world = MPI.COMM_WORLD
    if world.Get_size() != world_size:
        raise LauncherError(f"MPI_COMM_WORLD has {world.Get_size()} ranks but the launcher says {world_size}")
    delta = datetime.timedelta(seconds=timeout)
    node = world.Split_type(MPI.COMM_TYPE_SHARED)  # collective: every rank learns whether all share its node
    one_node = node.Get_size() == world_size
    node.Free()
    buf = bytearray(1024)  # "ok <host> <port>" or "error <message>", from rank 0
    store = None
    if world.Get_rank() == 0:
        try:
            host = "127.0.0.1" if one_node else _reachable_host()
            store = job_store(host, 0, world_size, True, delta)
            text = f"ok {host} {store.port}"
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            text = f"error {type(exc).__name__}: {exc}"
        raw = text.encode(errors="replace")[: len(buf)]
        buf[: len(raw)] = raw
    wait_requests([world.Ibcast([buf, MPI.BYTE], root=0)], timeout, "", keep=buf, message=lambda: (
        f"rank {world.Get_rank()}: no rendezvous address from rank 0 after {timeout:.0f}s; "
        f"did every rank call {call}?"))
    status, _, rest = bytes(buf).rstrip(b"\0").decode(errors="replace").partition(" ")
    if status != "ok":
        raise RemoteError(f"rendezvous: rank 0 could not open a TCPStore: {rest}", 0, rest)
    host, port = rest.split()
    return store or job_store(host, int(port), world_size, False, delta)


def _reachable_host() -> str:
    """A name of this host that the other ranks can connect to (its host name where it resolves)."""
    host = socket.gethostname()
    try:
        socket.getaddrinfo(host, None)
        return host
    except OSError:
        return "127.0.0.1"


def torchrun_store(info: WorldInfo, timeout: datetime.timedelta):  # -> torch.distributed.Store
    """torchrun's store for this restart attempt.  Its agent keeps one store for every attempt of a job, so the
    workers of a restarted attempt would read the addresses their killed predecessors published there (gloo
    then connects to dead ports); a prefix per attempt keeps each attempt's keys apart."""
    import torch.distributed as dist

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 hosts it, as env:// does
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
                          is_master=not agent and info.rank == 0, timeout=timeout)
    return dist.PrefixStore(f"torchhpc/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def job_rendezvous(info: WorldInfo, env: Mapping[str, str], timeout: datetime.timedelta):
    """The job's rendezvous store, at ``MASTER_ADDR:MASTER_PORT`` where set, else where the launcher's facts say:
    agreed through MPI, or (srun without MPI) Slurm's reserved port for the step (``--resv-ports``)."""
    master = info.rank == 0
    if "MASTER_ADDR" in env and "MASTER_PORT" in env:
        return job_store(env["MASTER_ADDR"], _port(env, "MASTER_PORT"), info.world_size, master, timeout)
    if info.world_size == 1:
        return job_store("127.0.0.1", 0, 1, True, timeout)
    if info.launcher in ("openmpi", "pals", "mpich", "mvapich", "mpi4py"):
        try:
            return agree_on_master(info.world_size, timeout.total_seconds())
        except ImportError as exc:
            raise LauncherError(f"MASTER_ADDR/MASTER_PORT are not set and mpi4py is unavailable ({exc})") from None
    if info.launcher == "slurm" and "SLURM_JOB_NODELIST" in env:
        # Slurm's port reserved for this step (srun --resv-ports, MpiParams=ports=) is the step's alone; without
        # one, a port from the job id: predictable, so another user may hold it first (rank 0 then says so)
        resv = env.get("SLURM_STEP_RESV_PORTS", "")
        port = int(re.split(r"[-,]", resv)[0]) if resv else 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
        return job_store(_slurm_first_host(env["SLURM_JOB_NODELIST"]), port, info.world_size, master, timeout)
    raise LauncherError(
        f"MASTER_ADDR/MASTER_PORT are not set and the {info.launcher} launcher gives no way to agree on them; "
        "export MASTER_ADDR=<rank 0's host> MASTER_PORT=<free port>"
    )


def _port(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise LauncherError(f"{name}={raw!r} is not a TCP port (1-65535)")
    return int(raw)
