"""Where each row lives: node shards, per-rank device chunks, the host tier, hot-row order.

Rows are addressed by *storage position*.  Node ``n`` holds the contiguous range
``node_starts[n]:node_starts[n+1]``; inside it, local rank ``j`` holds the next
``device_rows[n][j]`` rows in its device tier, and the rest sit in the node's host tier.
A hot-row order (hottest id first) deals ids round-robin over nodes, so every node's
device tier receives its share of the hottest rows: the ``k``-th hottest id goes to node
``k % N`` at offset ``k // N``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Layout", "plan_layout", "positions_from_order"]


@dataclass(frozen=True)
class Layout:
    """Row placement of one ChunkTensor (identical on every rank)."""

    num_rows: int
    row_bytes: int
    node_starts: tuple[int, ...]
    device_rows: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.device_rows)

    def node_rows(self, node: int) -> int:
        return self.node_starts[node + 1] - self.node_starts[node]

    def host_rows(self, node: int) -> int:
        return self.node_rows(node) - sum(self.device_rows[node])

    def segment_starts(self, node: int) -> list[int]:
        """Offsets inside the node shard where each device chunk and then the host tier begin."""
        starts = [0]
        for r in self.device_rows[node]:
            starts.append(starts[-1] + r)
        return starts  # len local_size + 1; last entry is where the host tier starts


def plan_layout(num_rows: int, row_bytes: int, capacity_per_device: int,
                ranks_per_node: list[int]) -> Layout:
    """Shard rows evenly over nodes; fill each node's device chunks evenly up to the capacity."""
    if capacity_per_device < 0:
        raise ValueError(f"capacity_per_device must be >= 0 bytes, got {capacity_per_device}")
    if 0 < capacity_per_device < row_bytes:
        raise ValueError(
            f"capacity_per_device={capacity_per_device} bytes is smaller than one row ({row_bytes} bytes); "
            f"it is a byte count per device: pass 0 for no device tier")
    cap_rows = capacity_per_device // row_bytes if row_bytes else 0
    n_nodes = len(ranks_per_node)
    base, extra = divmod(num_rows, n_nodes)
    starts = [0]
    for n in range(n_nodes):
        starts.append(starts[-1] + base + (1 if n < extra else 0))
    device_rows = []
    for n, local in enumerate(ranks_per_node):
        rows = starts[n + 1] - starts[n]
        per = min(cap_rows, -(-rows // local)) if local else 0
        chunk, left = [], rows
        for _ in range(local):
            take = min(per, left)
            chunk.append(take)
            left -= take
        device_rows.append(tuple(chunk))
    return Layout(num_rows, row_bytes, tuple(starts), tuple(device_rows))


def positions_from_order(order: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """From a hot-first permutation of ids, return (pos_of_id, id_at_pos) as int64 tensors."""
    n = layout.num_rows
    order = torch.as_tensor(order)
    if order.dtype not in (torch.int32, torch.int64) or order.dim() != 1 or order.numel() != n:
        raise ValueError(f"hot-row order must be a 1-D integer permutation of {n} row ids, "
                         f"got shape {tuple(order.shape)} dtype {order.dtype}")
    order = order.to(torch.int64)
    if n and (order.min() < 0 or order.max() >= n or torch.bincount(order, minlength=n).max() != 1):
        raise ValueError("hot-row order is not a permutation of the row ids (ids repeated or out of range)")
    k = torch.arange(n, dtype=torch.int64)
    nodes = layout.num_nodes
    node_start = torch.tensor(layout.node_starts[:-1], dtype=torch.int64)
    pos = node_start[k % nodes] + k // nodes
    pos_of = torch.empty(n, dtype=torch.int64)
    pos_of[order] = pos
    id_at = torch.empty(n, dtype=torch.int64)
    id_at[pos] = order
    return pos_of, id_at
