"""Which ranks share a node: the grouping that decides who maps whose shared memory."""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI

from ..runtime import settings

__all__ = ["NodeTopology", "node_topology"]

RANKS_PER_NODE_ENV = "TORCHHPC_RANKS_PER_NODE"
# One topology (and one node communicator) per (communicator, grouping): ChunkTensors come and go,
# communicators would pile up otherwise.
_CACHE: dict[tuple[int, int | None], NodeTopology] = {}


@dataclass(frozen=True)
class NodeTopology:
    """This rank's place in the job: its node, its local rank, and the ranks of every node."""

    comm: MPI.Comm
    node_comm: MPI.Comm
    rank: int
    size: int
    node: int
    local_rank: int
    node_ranks: tuple[tuple[int, ...], ...]  # comm ranks of each node, node-major

    @property
    def num_nodes(self) -> int:
        return len(self.node_ranks)

    @property
    def local_size(self) -> int:
        return len(self.node_ranks[self.node])


def node_topology(comm: MPI.Comm | None = None, ranks_per_node: int | None = None) -> NodeTopology:
    """Group the ranks of ``comm`` by node (collective).

    Nodes are found with ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``.  ``ranks_per_node``
    (or ``$TORCHHPC_RANKS_PER_NODE``) overrides that with blocks of consecutive ranks: for
    testing the cross-node tier on one machine, or for machines whose shared-memory domain is
    not what MPI reports.  Ranks grouped together must really share ``/dev/shm``.
    """
    comm = comm if comm is not None else MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if ranks_per_node is None:
        ranks_per_node = settings.get(RANKS_PER_NODE_ENV)
    if ranks_per_node is not None and ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    key = (comm.py2f(), ranks_per_node)
    if key in _CACHE:
        return _CACHE[key]
    if ranks_per_node is not None:
        color = rank // ranks_per_node
        node_comm = comm.Split(color, rank)
    else:
        node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    leader = node_comm.allreduce(rank, op=MPI.MIN)
    leaders = comm.allgather(leader)
    order = sorted(set(leaders))
    node_ranks = tuple(tuple(r for r in range(size) if leaders[r] == lead) for lead in order)
    topo = NodeTopology(comm=comm, node_comm=node_comm, rank=rank, size=size,
                        node=order.index(leader), local_rank=node_comm.Get_rank(), node_ranks=node_ranks)
    _CACHE[key] = topo
    return topo
