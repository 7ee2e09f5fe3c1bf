"""Tiered ChunkTensor (device / node-shared host / remote node) and GNN neighbor sampling.

- :class:`ChunkTensor` -- one logical 1-D/2-D tensor whose rows live in the ranks' device
  memory, a host tier shared once per node, and other nodes; any rank gathers any row.
- :class:`ChunkStoreOptions` -- its settings (device capacity, node grouping, CUDA, deadline).
- :func:`hot_order_by_degree` -- a hottest-first row order so frequent rows land in fast tiers.
- :func:`sample_neighbors`, :class:`NeighborSampler` -- uniform/weighted neighbor sampling over
  a CSC graph stored in ChunkTensors, with multi-layer minibatch blocks for GraphSAGE.
"""

from .chunk_tensor import SUPPORTED_DTYPES, ChunkTensor, IndexSplit, MemoryReport, TierPart
from .options import ChunkStoreOptions
from .ordering import hot_order_by_degree, hot_order_from_scores
from .sampling import Block, MiniBatch, NeighborSampler, sample_neighbors
from .shm import SharedMemoryTooSmall, reap_dead_segments
from .topology import NodeTopology, node_topology

__all__ = [
    "ChunkTensor", "ChunkStoreOptions", "IndexSplit", "MemoryReport", "TierPart", "SUPPORTED_DTYPES",
    "hot_order_by_degree", "hot_order_from_scores", "sample_neighbors", "NeighborSampler", "Block", "MiniBatch",
    "SharedMemoryTooSmall", "reap_dead_segments", "NodeTopology", "node_topology",
]
