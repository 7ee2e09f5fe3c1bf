"""torchhpc.runtime.topology on real machines' hwloc descriptions (hwloc's own test XMLs, tests/data/hwloc): every
rank beside its GPU and NIC, on whole cores of their NUMA node, and told where the machine does not allow it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchhpc.runtime import topology
from torchhpc.runtime.mpirun import local_job_env, mpi_flavor, mpiexec_argv, side_mpich, side_mpich_env

ROOT = Path(__file__).resolve().parent.parent
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


def test_the_plan_in_each_launchers_words() -> None:
    """The 2-socket machine's two ranks (GPU and InfiniBand on NUMA node 1) in srun's, PALS', Hydra's and Open
    MPI's binding words, and the maps the ranks read."""
    slots = topology.plan(topology.read_xml(DATA / "32em64t-2n8c2t-pci-normalio.xml"), 2)
    assert topology.maps(slots) == ("8-11,24-27:12-15,28-31", "0,0")
    assert topology.launch_words(slots, "srun") == ["--cpu-bind=mask_cpu:0xf000f00,0xf000f000",
                                                    "--gpu-bind=map_gpu:0,0"]
    assert topology.launch_words(slots, "pals") == ["--cpu-bind", "list:8-11,24-27:12-15,28-31"]
    assert topology.launch_words(slots, "hydra") == ["-bind-to", "user:8+9+10+11+24+25+26+27,12+13+14+15+28+29+30+31"]
    # hyperthreads numbered apart (8-11 with 24-27) are no consecutive block: Open MPI's ranks bind themselves
    assert topology.launch_words(slots, "openmpi") == ["--map-by", "ppr:2:node", "--bind-to", "none"]
    plain = topology.plan(topology.Node({0: (0, 1, 2, 3)}, tuple((c,) for c in range(4)), ()), 2)
    assert topology.launch_words(plain, "openmpi") == ["--map-by", "ppr:2:node:PE=2", "--bind-to", "core"]
    assert topology.maps(plain) == ("0-1:2-3", "")
    dgx = topology.plan(topology.read_xml(DATA / "nvidiaDGX2.xml"), 16)
    assert topology.launch_words(dgx, "srun")[1] == "--gpu-bind=map_gpu:" + ",".join(map(str, range(16)))
    with pytest.raises(ValueError, match="not one of srun"):
        topology.launch_words(plain, "aprun")


def _fake_sysfs(root: Path) -> Path:
    """A node as Linux shows it: 2 NUMA nodes of 2 cores x 2 threads, an NVIDIA GPU and a ConnectX NIC (net and
    InfiniBand names) behind one PCIe switch on NUMA node 1, a BMC's VGA and a virtual NIC that are neither."""
    for node, cpus in ((0, "0-1,4-5"), (1, "2-3,6-7")):
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(cpus + "\n")
    for cpu in range(8):
        (root / f"devices/system/cpu/cpu{cpu}/topology").mkdir(parents=True)
        (root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").write_text(f"{cpu % 4},{cpu % 4 + 4}\n")
    switch = root / "devices/pci0000:80/0000:80:01.0"
    for name, cls, vendor, numa in (("0000:81:00.0", "0x030200", "0x10de", 1), ("0000:82:00.0", "0x020700",
                                    "0x15b3", 1), ("0000:02:00.0", "0x030000", "0x1a03", 0)):
        dev = (switch if numa else root / "devices/pci0000:00/0000:00:02.0") / name
        dev.mkdir(parents=True)
        for key, value in (("class", cls), ("vendor", vendor), ("numa_node", str(numa))):
            (dev / key).write_text(value + "\n")
        (root / "bus/pci/devices").mkdir(parents=True, exist_ok=True)
        (root / "bus/pci/devices" / name).symlink_to(dev)
    for cls, name in (("net", "ib0"), ("infiniband", "mlx5_0")):
        (root / f"class/{cls}/{name}").mkdir(parents=True)
        (root / f"class/{cls}/{name}/device").symlink_to(switch / "0000:82:00.0")
    (root / "devices/virtual/net/lo").mkdir(parents=True)
    (root / "class/net/lo").mkdir(parents=True)
    (root / "class/net/lo/device").symlink_to(root / "devices/virtual/net/lo")
    return root


def test_a_node_read_from_sysfs_is_planned_as_from_hwloc(tmp_path: Path) -> None:
    node = topology.from_sysfs(_fake_sysfs(tmp_path))
    assert node.numa == {0: (0, 1, 4, 5), 1: (2, 3, 6, 7)}
    assert node.cores == ((0, 4), (1, 5), (2, 6), (3, 7))
    (gpu,) = node.of("gpu")
    (nic,) = node.of("nic")
    assert (gpu.names, gpu.busid, gpu.numa) == (("cuda0",), "0000:81:00.0", 1)
    assert (nic.names, nic.numa) == (("ib0", "mlx5_0"), 1) and topology._shared(gpu, nic) == 2
    (slot,) = topology.plan(node, 1)
    assert (slot.cores, slot.numa, slot.gpu, slot.nic, slot.notes) == ((2, 3, 6, 7), 1, gpu, nic, ())
    (tmp_path / "devices/system/cpu/online").write_text("0-2\n")  # core 3 (CPUs 3 and 7) taken offline
    assert topology.from_sysfs(tmp_path).cores == ((0, 4), (1, 5), (2, 6))


def test_the_command_prints_the_maps_the_source_and_the_words(capsys: pytest.CaptureFixture[str]) -> None:
    xml = DATA / "32em64t-2n8c2t-pci-normalio.xml"
    assert topology.main(["--ranks", "2", "--launcher", "pals", "--xml", str(xml)]) == 0
    assert capsys.readouterr().out.splitlines() == ["TORCHHPC_CPU_MAP=8-11,24-27:12-15,28-31", "TORCHHPC_GPU_MAP=0,0",
                                                    f"hwloc XML {xml}", "--cpu-bind", "list:8-11,24-27:12-15,28-31"]
    assert topology.main(["--ranks", "2", "--xml", str(xml)]) == 0
    table = capsys.readouterr().out
    assert "local rank 1: cores 12-15,28-31  NUMA 1  GPU cuda0 (0000:84:00.0)  NIC mlx5_0  !! 2 ranks for 1" in table
    with pytest.raises(SystemExit):
        topology.main(["--ranks", "0"])
    assert "--ranks must be at least 1, not 0" in capsys.readouterr().err


def _reversed_plan() -> list[topology.Slot]:
    """Two local ranks placed against the order any block rule gives (rank 0 on the last CPU): what a GPU node's
    plan looks like where GPU 0 sits beside the last cores."""
    cpus = sorted(os.sched_getaffinity(0))
    return [topology.Slot(0, (cpus[-1],), 0, None, None, ()), topology.Slot(1, (cpus[0],), 0, None, None, ())]


# one write per line: the ranks share the pipe, and print() under PYTHONUNBUFFERED writes piece by piece
CODE = ("import os, torchhpc; r = next(os.environ[v] for v in ('OMPI_COMM_WORLD_RANK', 'PMI_RANK') "
        "if v in os.environ); os.write(1, f'{r} {sorted(os.sched_getaffinity(0))}\\n'.encode())")


def _placed(argv: list[str], env: dict[str, str]) -> list[str]:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    return sorted(res.stdout.strip().splitlines())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_the_words_place_ranks_under_the_real_launchers() -> None:
    """The launchers here run the plan as written: MPICH's Hydra binds by its -bind-to user: words; Open MPI, which
    gets --bind-to none and the map (-x, as to other nodes), leaves the ranks to bind themselves from it."""
    slots = _reversed_plan()
    cpus, _ = topology.maps(slots)
    want = [f"0 [{slots[0].cores[0]}]", f"1 [{slots[1].cores[0]}]"]
    env = {**local_job_env(), "PYTHONPATH": str(ROOT / "src"), "TORCHHPC_CPU_MAP": cpus,
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    words = topology.launch_words(slots, "openmpi")
    assert words == ["--map-by", "ppr:2:node", "--bind-to", "none"]
    command = [sys.executable, "-c", CODE]
    if mpi_flavor() == "openmpi":
        assert _placed(mpiexec_argv(2, command, extra=[*words, "-x", "TORCHHPC_CPU_MAP"]), env) == want
    mpich = side_mpich() if mpi_flavor() == "openmpi" else None
    if mpich is None:
        pytest.skip("no MPICH beside Open MPI: make env puts it in $VENV/mpich")
    hydra = [str(mpich / "bin" / "mpiexec"), "-n", "2", *topology.launch_words(slots, "hydra"), *command]
    assert _placed(hydra, {**side_mpich_env(mpich, env), "TORCHHPC_CPU_MAP": ""}) == want


def _layout(entry: dict) -> topology.Node:
    """A node from docs/data/node_layouts.json: NUMA nodes of cores, hardware thread c + cores beside core c."""
    cores = entry["cores"]
    numa = {n: tuple(sorted(c + t * cores for c in topology.cpulist(text) for t in (0, 1)))
            for n, text in enumerate(entry["numa"])}
    gpus = tuple(topology.Device("gpu", (f"cuda{i}",), f"gpu{i}", n, ()) for i, n in enumerate(entry["gpu_numa"]))
    return topology.Node(numa, tuple((c, c + cores) for c in range(cores)), gpus)


def test_the_binding_docs_show_for_polaris_perlmutter_and_derecho_is_the_planners() -> None:
    """docs/cluster.md's table of the three machines' GPU nodes, 4 ranks each: each rank on its GPU's NUMA node,
    in the site launcher's words, as the planner makes them from the layouts in docs/data."""
    layouts = json.loads((ROOT / "docs/data/node_layouts.json").read_text())["nodes"]
    doc = (ROOT / "docs/cluster.md").read_text()
    for site, entry in layouts.items():
        slots = topology.plan(_layout(entry), 4)
        assert all(s.gpu and s.numa == s.gpu.numa and not s.notes[1:] for s in slots), slots
        cpus, gpus = topology.maps(slots)
        words = " ".join(topology.launch_words(slots, entry["launcher"]))
        row = f"| {site} | `{cpus.replace(':', ' / ')}` | `{gpus}` | `{words}` |"
        assert row in doc, f"docs/cluster.md lacks {site}'s row:\n{row}"
