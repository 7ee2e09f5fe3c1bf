"""torchhpc.runtime.topology on real machines' hwloc descriptions (hwloc's own test XMLs, tests/data/hwloc): every
rank beside its GPU and NIC, on whole cores of their NUMA node, and told where the machine does not allow it."""

from __future__ import annotations

from pathlib import Path

from torchhpc.runtime import topology

DATA = Path(__file__).with_name("data") / "hwloc"


def test_a_dgx2_gives_each_of_16_ranks_its_own_gpu_on_that_gpus_socket() -> None:
    node = topology.read_xml(DATA / "nvidiaDGX2.xml")
    gpus = node.of("gpu")
    assert len(gpus) == 16 and [g.names[0] for g in gpus] == [f"nvml{i}" for i in range(16)]
    assert [g.numa for g in gpus] == [0] * 8 + [1] * 8
    slots = topology.plan(node, 16)
    assert len({s.gpu.busid for s in slots}) == 16
    for s in slots:
        assert s.numa == s.gpu.numa and set(s.cores) <= set(node.numa[s.numa]), s
        assert "no NIC on this machine" in s.notes  # the file holds no network devices
    # 8 ranks on a socket of 2 cores (hwloc trimmed the file): said, not hidden
    assert all(any("8 ranks on 2 cores" in n for n in s.notes) for s in slots)


def test_ranks_share_the_gpus_socket_by_whole_cores_and_take_the_nic_beside_it() -> None:
    node = topology.read_xml(DATA / "32em64t-2n8c2t-pci-normalio.xml")
    (gpu,) = node.of("gpu")
    assert gpu.names[0] == "cuda0" and gpu.numa == 1 and gpu.busid == "0000:84:00.0"
    assert {n.names[0] for n in node.of("nic")} == {"eth0", "eth1", "mlx5_0"}
    first, second = topology.plan(node, 2)
    assert first.numa == second.numa == 1 and first.gpu == second.gpu == gpu
    assert not set(first.cores) & set(second.cores) and len(first.cores) == len(second.cores) == 8
    cores = {c for c in node.cores_of(1)}
    assert all(core in cores for core in node.cores if set(core) & set(first.cores))  # whole cores of NUMA 1
    assert not any(set(core) & set(first.cores) and set(core) & set(second.cores) for core in node.cores)
    assert first.nic.numa == 1 and first.notes == () and second.notes == ("2 ranks for 1 GPUs: shares cuda0",)


def test_without_gpus_ranks_spread_over_the_numa_nodes() -> None:
    node = topology.Node({0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}, tuple((c,) for c in range(8)), ())
    slots = topology.plan(node, 4)
    assert [s.numa for s in slots] == [0, 0, 1, 1]
    assert [s.cores for s in slots] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(s.gpu is None and s.notes == ("no NIC on this machine",) for s in slots)
