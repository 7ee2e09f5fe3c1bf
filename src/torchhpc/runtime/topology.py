"""A node's layout (which cores, GPUs and NICs share a NUMA node), a placement that keeps each local rank beside
its GPU and its NIC, and that placement in each launcher's own binding words.

The layout comes from hwloc's XML (topology format 2 and 3, read with the standard library: the file
``HWLOC_XMLFILE`` names, or ``lstopo --of xml`` where hwloc's tools are installed), else from Linux's sysfs; the
same functions plan for the machine at hand or for one described in a file.  The job layer runs
``python -m torchhpc.runtime.topology --ranks N --launcher L`` on a node it holds whole: it prints the maps the
ranks read (``TORCHHPC_CPU_MAP``, ``TORCHHPC_GPU_MAP``), where the layout came from, then the launcher's words.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Device", "Node", "Slot", "cpulist", "device_numa", "from_sysfs", "launch_words", "maps", "plan",
           "ranges", "read_xml", "this_node"]

LAUNCHERS = ("srun", "openmpi", "hydra", "pals")

# OSDev kinds: hwloc 3 writes a bitmask (GPU 4, COPROC 8, NETWORK 16, OPENFABRICS 32), hwloc 2 one number
_GPU_V3, _NIC_V3 = 4 | 8, 16 | 32
_GPU_V2, _NIC_V2 = {1, 5}, {2, 3}


@dataclass(frozen=True)
class Device:
    """A GPU or a NIC: its OS names, PCI bus id, NUMA node (None: several or unknown) and I/O ancestors' ids."""

    kind: str                 # "gpu" or "nic"
    names: tuple[str, ...]    # e.g. ("cuda0", "nvml0"), ("mlx5_0", "ib0")
    busid: str
    numa: int | None
    path: tuple[str, ...]


@dataclass(frozen=True)
class Node:
    """NUMA nodes (os index -> logical CPUs), physical cores (each its logical CPUs) and the GPUs and NICs."""

    numa: dict[int, tuple[int, ...]]
    cores: tuple[tuple[int, ...], ...]
    devices: tuple[Device, ...]

    def cores_of(self, numa: int | None) -> list[tuple[int, ...]]:
        """The physical cores of NUMA node ``numa`` (None: of the machine), in order."""
        mine = set(self.numa.get(numa, ())) if numa is not None else None
        return [c for c in self.cores if mine is None or set(c) <= mine]

    def of(self, kind: str) -> list[Device]:
        return sorted((d for d in self.devices if d.kind == kind), key=lambda d: (d.numa is None, d.numa, d.busid))


@dataclass(frozen=True)
class Slot:
    """Where local rank ``rank`` should run: its cores, their NUMA node, its GPU and NIC, and what is not ideal."""

    rank: int
    cores: tuple[int, ...]
    numa: int | None
    gpu: Device | None
    nic: Device | None
    notes: tuple[str, ...]


def _cpus(mask: str) -> set[int]:
    """The CPUs of an hwloc bitmask ("0x00ff00ff", or 32-bit words "0x000000ff,0xffffffff", high word first)."""
    words = [w for w in mask.split(",") if w]
    value = 0
    for word in words:
        value = (value << 32) | int(word, 16)
    return {bit for bit in range(value.bit_length()) if value >> bit & 1}


def _kind(obj: ET.Element, version: int) -> str | None:
    raw = int(obj.get("osdev_type", "-1"))
    if version >= 3:
        return "gpu" if raw & _GPU_V3 and obj.get("subtype") != "OpenCL" else "nic" if raw & _NIC_V3 else None
    return "gpu" if raw in _GPU_V2 else "nic" if raw in _NIC_V2 else None


def cpulist(text: str) -> list[int]:
    """The CPUs of a Linux cpulist ("0-3,8,10-11")."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def ranges(cpus: tuple[int, ...] | list[int]) -> str:
    """A cpulist again ("0-3,8")."""
    spans: list[list[int]] = []
    for c in sorted(cpus):
        if spans and spans[-1][1] == c - 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def device_numa(device: Path) -> int | None:
    """The NUMA node sysfs gives a device (None: none or unknown)."""
    try:
        value = int((device / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


def read_xml(path: str | Path) -> Node:
    """The node an hwloc XML file describes."""
    return _from_hwloc(ET.parse(path).getroot())


def _from_hwloc(root: ET.Element) -> Node:
    version = int(float(root.get("version", "2.0")))
    numa: dict[int, tuple[int, ...]] = {}
    cores: list[tuple[int, ...]] = []
    found: dict[tuple[str, str], tuple[list[str], str, set[int], tuple[str, ...]]] = {}

    def walk(obj: ET.Element, cpus: set[int], path: tuple[str, ...], busid: str) -> None:
        kind = obj.get("type")
        if kind == "NUMANode":
            numa[int(obj.get("os_index", "0"))] = tuple(sorted(_cpus(obj.get("cpuset", "0x0"))))
        if kind == "Core":
            cores.append(tuple(sorted(_cpus(obj.get("cpuset", "0x0")))))
        if kind == "OSDev" and (what := _kind(obj, version)) and busid:
            names, *_ = found.setdefault((what, busid), ([], busid, cpus, path))
            names.append(obj.get("name", "?"))
        here = _cpus(obj.get("cpuset")) if obj.get("cpuset") else cpus
        for child in obj.findall("object"):
            walk(child, here, (*path, obj.get("id", "")), obj.get("pci_busid", busid))

    for top in root.findall("object"):
        walk(top, set(), (), "")
    devices = []
    for (what, busid), (names, _, cpus, path) in found.items():
        near = [n for n, mine in numa.items() if cpus & set(mine)]
        # compute names first (cuda0 before the display's card0)
        named = tuple(sorted(names, key=lambda n: (not n.startswith(("cuda", "nvml", "rsmi", "mlx", "cxi")), n)))
        devices.append(Device(what, named, busid, near[0] if len(near) == 1 else None, path))
    return Node(numa, tuple(cores), tuple(devices))


def from_sysfs(root: Path = Path("/sys")) -> Node:
    """The node as Linux describes it: NUMA nodes, physical cores (hyperthread siblings together), NVIDIA and AMD
    GPUs in PCI order (named cuda0.. as CUDA orders them by default on a node of one GPU model) and NICs (net and
    InfiniBand devices with a PCI device behind them), each with its NUMA node and PCI path."""
    numa = {int(d.name[4:]): tuple(cpulist((d / "cpulist").read_text()))
            for d in root.glob("devices/system/node/node[0-9]*")}
    online = root / "devices/system/cpu/online"  # offline CPUs are no one's to bind to
    cpus = (cpulist(online.read_text()) if online.exists() else
            sorted(int(c.name[3:]) for c in root.glob("devices/system/cpu/cpu[0-9]*")))
    cores: dict[tuple[int, ...], None] = {}
    for cpu in cpus:
        siblings = root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        cores.setdefault(tuple(cpulist(siblings.read_text())) if siblings.exists() else (cpu,), None)
    devices = []

    def pci(dev: Path) -> tuple[str, tuple[str, ...]]:
        real = dev.resolve()
        return real.name, tuple(p.name for p in real.parents if p.name.startswith("pci") or ":" in p.name)

    gpus = [d for d in sorted((root / "bus/pci/devices").glob("*"))
            if _read(d / "class").startswith("0x03") and _read(d / "vendor") in ("0x10de", "0x1002")]
    for index, dev in enumerate(gpus):
        busid, path = pci(dev)
        devices.append(Device("gpu", (f"cuda{index}",), busid, device_numa(dev), path[::-1]))
    nics: dict[str, list[str]] = {}
    for nic in [*root.glob("class/net/*"), *root.glob("class/infiniband/*")]:
        if (nic / "device").exists() and "virtual" not in str((nic / "device").resolve()):
            nics.setdefault(str((nic / "device").resolve()), []).append(nic.name)
    for real, names in sorted(nics.items()):
        busid, path = pci(Path(real))
        devices.append(Device("nic", tuple(sorted(names)), busid, device_numa(Path(real)), path[::-1]))
    return Node(numa or {0: tuple(cpus)}, tuple(sorted(cores, key=min)), tuple(devices))


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def this_node() -> tuple[Node, str]:
    """This node's layout and where it came from: ``HWLOC_XMLFILE``, else ``lstopo --of xml``, else sysfs."""
    named = os.environ.get("HWLOC_XMLFILE")
    if named:
        return read_xml(named), f"hwloc XML {named}"
    lstopo = shutil.which("lstopo-no-graphics") or shutil.which("lstopo")
    if lstopo:
        out = subprocess.run([lstopo, "--of", "xml", "-"], capture_output=True, text=True, timeout=60, check=False)
        if out.returncode == 0:
            return _from_hwloc(ET.fromstring(out.stdout)), "lstopo"
    return from_sysfs(), "sysfs"


def _shared(a: Device, b: Device) -> int:
    """How deep the two devices' I/O paths agree (a NIC behind the GPU's own PCIe switch shares more)."""
    depth = 0
    for x, y in zip(a.path, b.path, strict=False):
        if x != y:
            break
        depth += 1
    return depth


def plan(node: Node, ranks: int) -> list[Slot]:
    """Local ranks 0..ranks-1, each given a GPU (in NUMA, then bus order), cores of that GPU's NUMA node split among
    the ranks placed there, and the NIC whose PCI path is closest to its GPU (else one on its NUMA node).  Without
    GPUs the ranks are spread over the NUMA nodes in blocks."""
    gpus = node.of("gpu")
    order = sorted(node.numa)
    homes = [gpus[r % len(gpus)].numa if gpus else order[r * len(order) // ranks] if order else None
             for r in range(ranks)]
    slots = []
    for r in range(ranks):
        gpu = gpus[r % len(gpus)] if gpus else None
        peers = [q for q in range(ranks) if homes[q] == homes[r]]
        pool = node.cores_of(homes[r])  # whole cores: a rank never gets another rank's hyperthread
        nic = _nic_for(node, gpu, homes[r])
        slots.append(Slot(r, _share(pool, peers.index(r), len(peers)), homes[r], gpu, nic,
                          _notes(r, gpu, nic, homes[r], len(gpus), len(pool), len(peers), ranks)))
    return slots


def _share(pool: list[tuple[int, ...]], index: int, count: int) -> tuple[int, ...]:
    """The logical CPUs of the ``index``-th of ``count`` equal shares of whole cores (all of them when too few)."""
    per = max(1, len(pool) // count)
    mine = pool[index * per:(index + 1) * per] if len(pool) >= count else pool
    return tuple(sorted(cpu for core in mine for cpu in core))


def _nic_for(node: Node, gpu: Device | None, numa: int | None) -> Device | None:
    """The NIC on ``numa`` (else any) whose PCI path is closest to ``gpu``'s, or the first of them."""
    nics = node.of("nic")
    near = [n for n in nics if n.numa == numa] or nics
    if not near:
        return None
    return max(near, key=lambda n: _shared(gpu, n)) if gpu else near[0]


def _notes(rank: int, gpu: Device | None, nic: Device | None, numa: int | None, gpus: int, cores: int, peers: int,
           ranks: int) -> tuple[str, ...]:
    notes = []
    if gpu and rank >= gpus:
        notes.append(f"{ranks} ranks for {gpus} GPUs: shares {gpu.names[0]}")
    if nic is None:
        notes.append("no NIC on this machine")
    elif numa is not None and nic.numa is not None and nic.numa != numa:
        notes.append(f"no NIC on NUMA node {numa}: {nic.names[0]} is on {nic.numa}")
    if cores < peers:
        notes.append(f"{peers} ranks on {cores} cores of NUMA node {numa}: they share them")
    return tuple(notes)


def _gpu_index(gpu: Device) -> int:
    """The GPU's index as CUDA, ROCm and Slurm's GRES number it (cuda2, nvml2, rsmi2: 2)."""
    digits = re.search(r"(\d+)$", gpu.names[0])
    return int(digits.group(1)) if digits else 0


def maps(slots: list[Slot]) -> tuple[str, str]:
    """The placement as the ranks read it: ``TORCHHPC_CPU_MAP`` (each local rank's CPUs, ranks apart by ":") and
    ``TORCHHPC_GPU_MAP`` (each local rank's GPU index, by ","; "" without GPUs)."""
    gpus = ",".join(str(_gpu_index(s.gpu)) for s in slots if s.gpu)
    return ":".join(ranges(s.cores) for s in slots), gpus if len(gpus.split(",")) == len(slots) else ""


def launch_words(slots: list[Slot], launcher: str) -> list[str]:
    """The placement in ``launcher``'s own binding words: srun ``--cpu-bind=mask_cpu:`` (and ``--gpu-bind=
    map_gpu:``), Cray PALS ``--cpu-bind list:``, MPICH's Hydra ``-bind-to user:``, Open MPI ``--map-by ppr:N:node:
    PE=C --bind-to core`` where the placement is consecutive blocks of C cores (else ``--bind-to none``: Open MPI has
    no per-rank list but a rankfile, and the ranks bind themselves from ``TORCHHPC_CPU_MAP`` at import)."""
    sets = [s.cores for s in slots]
    if launcher == "srun":
        words = ["--cpu-bind=mask_cpu:" + ",".join(hex(sum(1 << c for c in cpus)) for cpus in sets)]
        gpus = maps(slots)[1]
        return words + [f"--gpu-bind=map_gpu:{gpus}"] if gpus else words
    if launcher == "pals":
        return ["--cpu-bind", "list:" + ":".join(ranges(cpus) for cpus in sets)]
    if launcher == "hydra":
        return ["-bind-to", "user:" + ",".join("+".join(map(str, cpus)) for cpus in sets)]
    if launcher == "openmpi":
        per = len(sets[0]) if sets else 0
        flat = [cpu for cpus in sets for cpu in cpus]
        blocks = per and all(len(c) == per for c in sets) and flat == sorted(flat) and len(set(flat)) == len(flat)
        if blocks:
            return ["--map-by", f"ppr:{len(sets)}:node:PE={per}", "--bind-to", "core"]
        return ["--map-by", f"ppr:{len(sets)}:node", "--bind-to", "none"]
    raise ValueError(f"launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}")


def _table(slots: list[Slot]) -> str:
    """One line per local rank: cores, NUMA node, GPU (bus id), NIC and what is not ideal."""
    lines = []
    for s in slots:
        gpu = f"{s.gpu.names[0]} ({s.gpu.busid})" if s.gpu else "none"
        nic = s.nic.names[0] if s.nic else "none"
        note = f"  !! {'; '.join(s.notes)}" if s.notes else ""
        lines.append(f"local rank {s.rank}: cores {ranges(s.cores)}  NUMA {s.numa}  GPU {gpu}  NIC {nic}{note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m torchhpc.runtime.topology --ranks N [--launcher L | --table] [--xml FILE]``."""
    ap = argparse.ArgumentParser(prog="python -m torchhpc.runtime.topology", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, required=True, help="ranks on the node")
    ap.add_argument("--launcher", choices=LAUNCHERS, help="print the maps, the layout's source and its words")
    ap.add_argument("--xml", help="an hwloc XML file to plan for (default: this node)")
    args = ap.parse_args(argv)
    if args.ranks < 1:
        ap.error(f"--ranks must be at least 1, not {args.ranks}")
    node, source = (read_xml(args.xml), f"hwloc XML {args.xml}") if args.xml else this_node()
    slots = plan(node, args.ranks)
    if args.launcher is None:
        print(f"{args.ranks} rank(s) on a node of {len(node.cores)} cores, {len(node.numa)} NUMA node(s), "
              f"{len(node.of('gpu'))} GPU(s), {len(node.of('nic'))} NIC(s) ({source}):\n{_table(slots)}")
        return 0
    cpus, gpus = maps(slots)
    print(f"TORCHHPC_CPU_MAP={cpus}\nTORCHHPC_GPU_MAP={gpus}\n{source}", *launch_words(slots, args.launcher), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
