"""Every rank prints one JSON line: where it runs, what the launcher says and what MPI says about its node, and
torch's threads against the CPUs it may use.

Run across the virtual cluster by tests/test_vcluster.py under each launcher; the test compares the
launcher's facts (torchhpc.launcher.world_info) with the hostnames the ranks really run on."""

import json
import os
import socket

import torch
from mpi4py import MPI

from torchhpc.chunkstore import node_topology
from torchhpc.launcher import world_info
from torchhpc.runtime.threads import thread_budget

world = MPI.COMM_WORLD
info = world_info()
topo = node_topology(world)
shm = os.statvfs("/dev/shm")
record = {
    "rank": world.Get_rank(), "size": world.Get_size(), "host": socket.gethostname(),
    "launcher": info.launcher, "info_rank": info.rank, "info_size": info.world_size,
    "local_rank": info.local_rank, "local_size": info.local_size,
    "mpi_local_size": topo.local_size, "mpi_nodes": topo.num_nodes,
    "shm_dev": os.stat("/dev/shm").st_dev, "shm_blocks": shm.f_blocks,
    "mpi": MPI.Get_library_version().split("\n")[0].strip()[:30],
    "threads": torch.get_num_threads(), "cpus": len(os.sched_getaffinity(0)), "node_cpus": os.cpu_count(),
    "budget": thread_budget().describe(),
}
for r in range(world.Get_size()):  # one rank at a time: lines never interleave
    if r == world.Get_rank():
        print("WHOAMI " + json.dumps(record), flush=True)
    world.Barrier()
