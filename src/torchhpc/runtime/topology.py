"""A node's layout as hwloc describes it (``lstopo --of xml``, the file ``HWLOC_XMLFILE`` names): which cores, GPUs
and NICs share a NUMA node, and a placement that keeps each local rank beside its GPU and its NIC.

Read from hwloc's XML (topology format 2 and 3) with the standard library: no hwloc binding is needed to plan, and
the same function plans for a machine at hand (``lstopo --of xml``) or for one described in a file.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Device", "Node", "Slot", "plan", "read_xml"]

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


def read_xml(path: str | Path) -> Node:
    """The node an hwloc XML file describes."""
    root = ET.parse(path).getroot()
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
    elif numa is not None and nic.numa != numa:
        notes.append(f"no NIC on NUMA node {numa}: {nic.names[0]} is on {nic.numa}")
    if cores < peers:
        notes.append(f"{peers} ranks on {cores} cores of NUMA node {numa}: they share them")
    return tuple(notes)
