"""``torchhpc doctor --bindings``: where each rank of a job runs, one line per rank, and what is wrong with it.

Run it as the job's ranks are run (``mpiexec -n 8 torchhpc doctor --bindings``, ``srun ...``).  Each rank reads
its own placement from Linux (the cores it may run on, their NUMA nodes, from ``sched_getaffinity`` and
``/sys/devices/system/node``), its GPU (the one torch gives it, with its PCI bus id and NUMA node) and the network
interfaces on its NUMA node; rank 0 prints every rank's line and flags what costs speed: two ranks of one host
sharing cores, a GPU or NIC on another NUMA node than the rank's cores, a rank free to run on every core.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .runtime.topology import cpulist, device_numa, ranges

__all__ = ["Placement", "gathered", "placement", "problems", "report"]

SYS = Path("/sys")


@dataclass
class Placement:
    """One rank's place on its node."""

    rank: int
    host: str
    cores: list[int]
    numa: list[int]                      # the NUMA nodes of those cores
    node_cores: int                      # the cores of the whole node
    gpu: str = ""                        # "cuda:0 0000:07:00.0", "" without one
    gpu_numa: int | None = None
    nics: list[str] = field(default_factory=list)  # physical interfaces on the rank's NUMA nodes


def _numa_of_cores(cores: list[int], sys_root: Path) -> list[int]:
    nodes = []
    for node in sorted(sys_root.glob("devices/system/node/node[0-9]*")):
        if set(cpulist((node / "cpulist").read_text())) & set(cores):
            nodes.append(int(node.name[4:]))
    return nodes


def _gpu(sys_root: Path) -> tuple[str, int | None]:
    try:
        import torch
    except ImportError:
        return "", None
    if not torch.cuda.is_available():
        return "", None
    index = torch.cuda.current_device()
    bus = getattr(torch.cuda.get_device_properties(index), "pci_bus_id", "")  # e.g. "0000:07:00.0"
    return f"cuda:{index} {bus}".strip(), device_numa(sys_root / "bus/pci/devices" / str(bus).lower()) if bus else None


def _nics(numa: list[int], sys_root: Path) -> list[str]:
    """Physical network interfaces (a device behind them) on the given NUMA nodes, or with no NUMA node given."""
    out = []
    for nic in sorted((sys_root / "class/net").glob("*")):
        device = nic / "device"
        if not device.exists() or "virtual" in str(device.resolve()):
            continue
        where = device_numa(device)
        if where is None or where in numa:
            out.append(nic.name)
    return out


def placement(rank: int = 0, sys_root: Path = SYS) -> Placement:
    """This process's placement as Linux and torch see it."""
    cores = sorted(os.sched_getaffinity(0))
    numa = _numa_of_cores(cores, sys_root)
    gpu, gpu_numa = _gpu(sys_root)
    return Placement(rank, socket.gethostname(), cores, numa, os.cpu_count() or len(cores), gpu, gpu_numa,
                     _nics(numa, sys_root))


def problems(ranks: list[Placement]) -> dict[int, list[str]]:
    """What costs each rank speed: shared cores on its host, a GPU off its NUMA nodes, no binding at all."""
    found: dict[int, list[str]] = {p.rank: [] for p in ranks}
    for p in ranks:
        for q in ranks:
            shared = set(p.cores) & set(q.cores)
            if q.rank != p.rank and q.host == p.host and shared:
                found[p.rank].append(f"shares cores {ranges(sorted(shared))} with rank {q.rank}")
        if p.gpu and p.gpu_numa is not None and p.gpu_numa not in p.numa:
            found[p.rank].append(f"its GPU is on NUMA node {p.gpu_numa}, its cores on {ranges(p.numa)}")
        if len(ranks) > 1 and len(p.cores) == p.node_cores and sum(q.host == p.host for q in ranks) > 1:
            found[p.rank].append("unbound: free to run on every core of the node")
    return found


def report(ranks: list[Placement]) -> str:
    """One line per rank (host, cores, NUMA, GPU, NICs), each followed by what is wrong with it."""
    flagged = problems(ranks)
    lines = []
    for p in sorted(ranks, key=lambda p: p.rank):
        gpu = f"{p.gpu} (NUMA {p.gpu_numa if p.gpu_numa is not None else '?'})" if p.gpu else "none"
        lines.append(f"rank {p.rank:<4} {p.host:<16} cores {ranges(p.cores):<12} NUMA {ranges(p.numa) or '?':<4} "
                     f"GPU {gpu}  NIC {','.join(p.nics) or 'none'}")
        lines += [f"  !! {why}" for why in flagged[p.rank]]
    bad = sum(bool(v) for v in flagged.values())
    lines.append(f"{len(ranks)} rank(s), {bad} with a problem" if bad else f"{len(ranks)} rank(s), each placed apart")
    return "\n".join(lines)


def gathered() -> list[Placement]:
    """Every rank's placement at rank 0 (MPI when the job was started by an MPI launcher; else this process's)."""
    from .runtime.world import mpi_launcher

    if mpi_launcher() is None:
        return [placement()]
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mine = json.dumps(asdict(placement(comm.Get_rank())))  # text, never a peer's pickle
    return [Placement(**json.loads(text)) for text in comm.gather(mine, root=0) or []]
