"""torchhpc doctor --bindings: each rank's cores, NUMA node, GPU and NIC as Linux shows them, and the report's flags,
under mpiexec with and without binding, and on a two-socket machine's /sys laid out as Linux lays it out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchhpc import bindings
from torchhpc.bindings import Placement

ROOT = Path(__file__).resolve().parents[1]


def doctor(*mpiexec_flags: str) -> subprocess.CompletedProcess[str]:
    """`mpiexec -n 2 FLAGS python -m torchhpc doctor --bindings --strict` with this environment's Open MPI."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    return subprocess.run([mpiexec, "-n", "2", *mpiexec_flags, sys.executable, "-m", "torchhpc", "doctor",
                           "--bindings", "--strict"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="fewer than 2 CPUs: two ranks cannot be bound apart")
def test_bound_ranks_are_apart_and_unbound_ones_are_flagged() -> None:
    bound = doctor("--bind-to", "core")
    assert bound.returncode == 0, bound.stdout + bound.stderr
    lines = [line for line in bound.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and "cores 0 " in lines[0] and "cores 1 " in lines[1], bound.stdout
    assert "2 rank(s), each placed apart" in bound.stdout
    loose = doctor("--bind-to", "none")
    assert loose.returncode == 1, loose.stdout + loose.stderr  # --strict: a problem fails
    assert "!! shares cores 0-1 with rank 1" in loose.stdout and "!! unbound" in loose.stdout, loose.stdout


def fake_sys(root: Path) -> Path:
    """Two NUMA nodes of 4 cores, a GPU on node 1 and NICs on each (Linux's /sys layout, numbers made up)."""
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        d = root / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    for bus, numa in (("0000:07:00.0", 1), ("0000:41:00.0", 0), ("0000:c1:00.0", 1)):
        d = root / "bus/pci/devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{numa}\n")
    for nic, bus in (("hsn0", "0000:41:00.0"), ("hsn1", "0000:c1:00.0")):
        (root / "class/net" / nic).mkdir(parents=True)
        (root / "class/net" / nic / "device").symlink_to(root / "bus/pci/devices" / bus)
    return root


def test_numa_nodes_and_nics_come_from_sys(tmp_path: Path) -> None:
    root = fake_sys(tmp_path)
    assert bindings._numa_of_cores([4, 5], root) == [1] and bindings._numa_of_cores([3, 4], root) == [0, 1]
    assert bindings._nics([0], root) == ["hsn0"] and bindings._nics([1], root) == ["hsn1"]


def test_a_gpu_on_another_numa_node_and_shared_cores_are_flagged() -> None:
    near = Placement(0, "n1", [0, 1], [0], 8, "cuda:0 0000:41:00.0", 0, ["hsn0"])
    far = Placement(1, "n1", [1, 2], [0], 8, "cuda:1 0000:c1:00.0", 1, ["hsn0"])
    other_host = Placement(2, "n2", [0, 1], [0], 8)
    found = bindings.problems([near, far, other_host])
    assert found[0] == ["shares cores 1 with rank 1"]
    assert found[1] == ["shares cores 1 with rank 0", "its GPU is on NUMA node 1, its cores on 0"]
    assert found[2] == []
    text = bindings.report([near, far, other_host])
    assert "GPU cuda:1 0000:c1:00.0 (NUMA 1)" in text and text.endswith("3 rank(s), 2 with a problem"), text
