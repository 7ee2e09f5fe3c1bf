"""ChunkTensor: one logical tensor over device, node-shared host and remote-node memory.

Every rank can gather any row.  Rows of this node are read straight from memory that all
local ranks map: each local rank's "device" chunk and the node's host tier.

- With CUDA, a device chunk is that rank's GPU memory, opened by its local peers through CUDA
  IPC, and the host tier is one shared-memory segment per node, page-locked with
  ``cudaHostRegister``.
- Without CUDA, a rank's "device" memory is ordinary host memory, so the node keeps one
  shared-memory segment for its whole shard: the device chunks are its leading sub-ranges
  (accounted per rank) and the host tier the rest.  Local peers read any chunk directly, and a
  gather of rows from any mix of local tiers is one ``index_select``.

Rows held by other nodes are fetched by all-to-all exchanges (counts and ids over MPI, rows over
torch.distributed; see :mod:`.exchange`), so a gather is collective only when the tensor spans
more than one node.  Every collective step waits for its peers with a deadline, and a bad input
on one rank makes every rank of that step raise.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ..runtime.waiting import agreed, allgather_object, barrier, wait_requests, wait_works
from .exchange import RowExchange
from .layout import Layout, plan_layout, positions_from_order
from .options import DEFAULT_TIMEOUT, ChunkStoreOptions
from .shm import Segment
from .topology import NodeTopology, node_topology

__all__ = ["ChunkTensor", "TierPart", "IndexSplit", "MemoryReport", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64)
_NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16,
                 torch.bfloat16: np.uint16, torch.float32: np.float32, torch.float64: np.float64}
_INDEX_DTYPES = (torch.int32, torch.int64)
_index_select = torch.index_select
_LOAD_BLOCK_BYTES = 64 << 20  # rows are copied in blocks of this size: bounded extra memory


def _agreement_timeout(options: ChunkStoreOptions | None, timeout: object) -> float:
    """Deadline of the constructor's first agreement, before the settings are known to be valid."""
    t = timeout if timeout is not None else getattr(options, "timeout", DEFAULT_TIMEOUT)
    return float(t) if isinstance(t, int | float) and t > 0 else DEFAULT_TIMEOUT


def _as_index(idx: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``idx`` as a tensor, keeping its dtype (so float ids are refused, not truncated); [] is int64."""
    if isinstance(idx, torch.Tensor):
        return idx
    t = torch.as_tensor(idx)
    return t.to(torch.int64) if t.numel() == 0 else t


class TierPart(NamedTuple):
    """Rows of one tier inside an index: ``order`` are positions in the index, ``ids`` the row ids."""

    order: torch.Tensor
    ids: torch.Tensor


class IndexSplit(NamedTuple):
    """An index split by where its rows live, as seen from this rank."""

    local: TierPart  # this rank's device chunk
    device: TierPart  # device chunks of the other local ranks
    host: TierPart  # this node's host tier
    remote: TierPart  # other nodes


@dataclass
class MemoryReport:
    """Bytes held per tier, per rank and per node (host tier counted once, on its node).

    ``exchange_buffer_bytes`` is the kept send/receive space of cross-node gathers (see
    :class:`~torchhpc.chunkstore.exchange.RowExchange`), 0 on one node.
    """

    per_rank: list[dict[str, int]]
    per_node: list[dict[str, int]]

    def __str__(self) -> str:
        lines = ["rank node device_bytes host_bytes_mapped exchange_buffer_bytes", *(
            f"{r['rank']:>4} {r['node']:>4} {r['device_bytes']:>12} {r['host_bytes_mapped']:>17} "
            f"{r['exchange_buffer_bytes']:>21}" for r in self.per_rank), "node device_bytes host_bytes total_bytes", *(
            f"{n['node']:>4} {n['device_bytes']:>12} {n['host_bytes']:>10} {n['total_bytes']:>11}"
            for n in self.per_node)]
        return "\n".join(lines)


class ChunkTensor:
    """A 1-D or 2-D tensor whose rows are spread over the ranks' devices, node host memory and nodes.

    Construction is collective over ``comm``.  Rows go first to the device tier of each local rank (up to
    ``capacity_per_device`` bytes, spread evenly), the rest of the node's rows to its shared host tier; with
    several nodes the rows are sharded evenly by node.  ``hot_order`` (a permutation of row ids, hottest
    first; read on rank 0) places the hottest rows in the fastest tiers while callers keep using the
    original ids.  ``comm`` carries the metadata of cross-node gathers and, by default, their host rows;
    ``group`` (default: the default group; the ranks of ``comm``) carries the rows with an NCCL group or
    ``row_transport="group"``.

    The settings (``capacity_per_device``, ``ranks_per_node``, ``use_cuda``, ``timeout``, ``row_transport``)
    are the fields of :class:`~torchhpc.chunkstore.ChunkStoreOptions`, each documented there: given as
    keywords, or as ``options=ChunkStoreOptions(...)``, or both (keywords that are not ``None`` override the
    options' fields).  No collective step (construction, loading, reports, cross-node gathers) waits for its peers
    longer than ``timeout`` seconds; past it a :class:`~torchhpc.runtime.errors.PeerTimeoutError` (a
    ``TimeoutError``) is raised, and an error on one rank of a step is raised on every rank of it.
    """

    def __init__(
        self,
        shape: int | Sequence[int],
        dtype: torch.dtype,
        capacity_per_device: int | None = None,
        group: dist.ProcessGroup | None = None,
        *,
        comm: MPI.Comm | None = None,
        hot_order: torch.Tensor | None = None,
        ranks_per_node: int | None = None,
        use_cuda: bool | None = None,
        timeout: float | None = None,
        row_transport: str | None = None,
        options: ChunkStoreOptions | None = None,
    ):
        given = {"capacity_per_device": capacity_per_device, "ranks_per_node": ranks_per_node,
                 "use_cuda": use_cuda, "timeout": timeout, "row_transport": row_transport}
        comm = MPI.COMM_WORLD if comm is None else comm
        self._closed = False
        self._segments: list[Segment] = []
        self._ipc_keep: list[torch.Tensor] = []
        # Every later step is collective: first every rank checks its arguments and the ranks agree (an
        # error on one rank is an error on all, naming it), all within the deadline.
        with agreed(comm, _agreement_timeout(options, timeout), "ChunkTensor()", keep_type=True):
            self._configure(shape, dtype, options, given)
        self.topo: NodeTopology = node_topology(comm, self.options.ranks_per_node)
        with self._step("ChunkTensor()"):
            self._plan(group)
        self._exchange: RowExchange | None = None
        if self.topo.num_nodes > 1:
            self._exchange = RowExchange(self.topo.comm, self.group, self.comm_device, self.row_bytes,
                                         self.timeout, self.options.row_transport)
        self._open_memory(hot_order)
        self._init_index()

    # ------------------------------------------------------------------ construction steps
    def _configure(self, shape: int | Sequence[int], dtype: torch.dtype, options: ChunkStoreOptions | None,
                   given: dict[str, object]) -> None:
        """Validate the arguments (local): the tensor's shape and dtype, and the settings."""
        try:
            shape = (operator.index(shape),) if not isinstance(shape, Sequence) else \
                tuple(operator.index(s) for s in shape)
        except TypeError:
            raise TypeError(f"ChunkTensor shape must be an int or a sequence of ints, got {shape!r}") from None
        if len(shape) not in (1, 2) or any(s < 0 for s in shape):
            raise ValueError(f"ChunkTensor shape must be 1-D or 2-D with sizes >= 0, got {shape}")
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"ChunkTensor dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        if options is None and given["capacity_per_device"] is None:
            raise TypeError("ChunkTensor needs capacity_per_device (bytes) or options=ChunkStoreOptions(...)")
        opts = ChunkStoreOptions.resolve(options, **given)
        opts.validate()
        self.options = opts
        self.timeout = float(opts.timeout)
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.row_shape = tuple(shape[1:])
        self.row_bytes = math.prod(self.row_shape) * torch.empty((), dtype=dtype).element_size()
        self.capacity_per_device = opts.capacity_bytes

    def _plan(self, group: dist.ProcessGroup | None) -> None:
        """Choose the device and the layout of the rows over nodes and tiers (local, given the topology)."""
        topo = self.topo
        self.group = None
        self.comm_device = torch.device("cpu")
        use_cuda = self.options.use_cuda
        self.use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        if self.use_cuda and not torch.cuda.is_available():
            raise RuntimeError("use_cuda=True but torch.cuda.is_available() is False")
        self.device = (torch.device("cuda", topo.local_rank % torch.cuda.device_count())
                       if self.use_cuda else torch.device("cpu"))
        self.layout: Layout = plan_layout(self.shape[0], self.row_bytes, self.capacity_per_device,
                                          [len(r) for r in topo.node_ranks])
        if topo.num_nodes > 1:
            self.group = self._check_group(group)

    def _check_group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        topo = self.topo
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"this ChunkTensor spans {topo.num_nodes} nodes: initialise torch.distributed (any backend) "
                "before creating it; remote rows are fetched with all-to-all over it")
        if dist.get_world_size(group) != topo.size or dist.get_rank(group) != topo.rank:
            raise RuntimeError(
                f"torch.distributed group (rank {dist.get_rank(group)} of {dist.get_world_size(group)}) does "
                f"not match the MPI communicator (rank {topo.rank} of {topo.size}); pass a matching group")
        self.comm_device = self.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        return group

    @contextmanager
    def _setup_step(self) -> Iterator[None]:
        """One set-up step, agreed over every rank: a failure on any rank releases what was mapped, on all."""
        try:
            with self._step("ChunkTensor()"):
                yield
        except BaseException:
            self.close()
            raise

    def _open_memory(self, hot_order: torch.Tensor | None) -> None:
        """Collective: create this node's segments, map every local rank's memory, then the hot-row order."""
        ordered = self._check_same_tensor(hot_order is not None)
        with self._setup_step():
            mine, dev_tensor = self._create_segments(ordered)
        what = "ChunkTensor() memory set-up"
        node_comm = self.topo.node_comm
        descs = allgather_object(node_comm, mine, self.timeout, what)
        cuda_handles = None
        if self.use_cuda:
            from torch.multiprocessing.reductions import reduce_tensor
            cuda_handles = allgather_object(node_comm, reduce_tensor(dev_tensor) if dev_tensor.numel() else None,
                                            self.timeout, what)
        # Map the peers' segments, then let owners unlink the names: nothing can leak after this.
        with self._setup_step():
            try:
                self._map_segments(descs, dev_tensor, cuda_handles)
            finally:
                barrier(node_comm, self.timeout, what)
                for s in self._segments:
                    s.unlink()
        if self.use_cuda and self._host_view.numel():
            # Page-lock the host tier so copies to the GPU run at full speed (cudaHostRegisterDefault).
            torch.cuda.cudart().cudaHostRegister(self._host_view.data_ptr(), self._host_seg.nbytes, 0)
            self._registered = self._host_view.data_ptr()
        if ordered:
            self._fill_order(hot_order)

    def _check_same_tensor(self, have_order: bool) -> bool:
        """Collective: refuse, on every rank, ranks that describe different tensors; whether rank 0 gave an order."""
        # Every rank must describe the same tensor, or the layouts (and every gather) would disagree.
        sig = (tuple(self.shape), str(self.dtype), self.capacity_per_device, self.use_cuda)
        sigs = allgather_object(self.topo.comm, (sig, have_order), self.timeout, "ChunkTensor()")
        bad = [r for r, (s, _) in enumerate(sigs) if s != sigs[0][0]]
        if bad:
            raise ValueError(f"ChunkTensor (shape, dtype, capacity_per_device, use_cuda) differ between "
                             f"ranks: rank 0 has {sigs[0][0]}, rank {bad[0]} has {sigs[bad[0]][0]}")
        return bool(sigs[0][1])

    def _create_segments(self, ordered: bool) -> tuple[dict[str, tuple[str, int] | None], torch.Tensor | None]:
        """This rank's device chunk (CUDA) and, on a node's first rank, the node's segments (local)."""
        lay, node = self.layout, self.topo.node
        mine: dict[str, tuple[str, int] | None] = {"host": None, "map": None}
        dev_tensor = None
        if self.use_cuda:
            rows = lay.device_rows[node][self.topo.local_rank]
            dev_tensor = torch.empty((rows, *self.row_shape), dtype=self.dtype, device=self.device)
        if self.topo.local_rank == 0:
            # With CUDA the segment is the host tier; without, it holds the whole node shard and
            # the ranks' device chunks are its leading sub-ranges (see _gather_node).
            seg = Segment.create((lay.host_rows(node) if self.use_cuda else lay.node_rows(node)) * self.row_bytes)
            self._segments.append(seg)
            mine["host"] = (str(seg.path), seg.nbytes)
            if ordered:
                seg = Segment.create(2 * 8 * lay.num_rows)
                self._segments.append(seg)
                mine["map"] = (str(seg.path), seg.nbytes)
        return mine, dev_tensor

    def _attach(self, desc: tuple[str, int]) -> Segment:
        """The segment ``desc`` names: this rank's own, or a peer's mapped here (kept for :meth:`close`)."""
        seg = next((s for s in self._segments if str(s.path) == desc[0]), None) or Segment.attach(*desc)
        if seg not in self._segments:
            self._segments.append(seg)
        return seg

    def _map_segments(self, descs: list[dict], dev_tensor: torch.Tensor | None, cuda_handles: list | None) -> None:
        """Views of the node's host tier, every local rank's device chunk and the hot-row maps (local)."""
        lay, node, lr = self.layout, self.topo.node, self.topo.local_rank
        seg = self._host_seg = self._attach(descs[0]["host"])
        seg_rows = lay.host_rows(node) if self.use_cuda else lay.node_rows(node)
        whole = seg.tensor.view(self.dtype).view(seg_rows, *self.row_shape)
        starts = lay.segment_starts(node)
        self._node_view = None if self.use_cuda else whole
        self._host_view = whole if self.use_cuda else whole[starts[-1]:]
        self._device_views: list[torch.Tensor] = []
        for j in range(len(descs)):
            if not self.use_cuda:
                self._device_views.append(whole[starts[j]:starts[j + 1]])
                continue
            if j == lr:
                t = dev_tensor
            elif cuda_handles[j] is None:
                t = torch.empty((0, *self.row_shape), dtype=self.dtype, device=self.device)
            else:
                fn, args = cuda_handles[j]
                t = fn(*args)
            self._ipc_keep.append(t)
            self._device_views.append(t)
        self._pos_of = self._id_at = None
        if descs[0]["map"] is not None:
            maps = self._attach(descs[0]["map"]).tensor.view(torch.int64).view(2, lay.num_rows)
            self._pos_of, self._id_at = maps[0], maps[1]

    def _init_index(self) -> None:
        """The lookup structures every gather uses (local)."""
        topo, lay, node = self.topo, self.layout, self.topo.node
        starts = lay.segment_starts(node)
        self._seg_starts = starts
        self._row_size = torch.Size(self.row_shape)
        self._fast = (self._node_view is not None and topo.num_nodes == 1 and self._pos_of is None
                      and self.num_rows > 0)
        self._bounds = torch.tensor(starts[1:], dtype=torch.int64)  # bucket edges: device chunks, host
        self._node_start = lay.node_starts[node]
        self._node_end = lay.node_starts[node + 1]
        self._node_edges = torch.tensor(lay.node_starts[1:-1], dtype=torch.int64)
        # rank that serves this rank's requests on each node: the same local rank, wrapped if that node is smaller
        lr = topo.local_rank
        self._dest_of_node = torch.tensor([r[lr % len(r)] for r in topo.node_ranks], dtype=torch.int64)

    def _fill_order(self, hot_order: torch.Tensor | None) -> None:
        """Collective: rank 0 turns ``hot_order`` into the position maps; node leaders write them."""
        topo = self.topo
        pos_of = id_at = None
        with self._setup_step():
            if topo.rank == 0:
                pos_of, id_at = positions_from_order(hot_order, self.layout)
        what = "ChunkTensor() hot-row order"
        leaders = topo.comm.Split(0 if topo.local_rank == 0 else MPI.UNDEFINED, topo.rank)
        if topo.local_rank == 0:
            buf = torch.stack([pos_of, id_at]) if topo.rank == 0 else torch.empty(2, self.layout.num_rows,
                                                                                   dtype=torch.int64)
            data = buf.numpy()
            wait_requests([leaders.Ibcast(data, root=0)], self.timeout, what, keep=(buf, data))
            self._pos_of.copy_(buf[0])
            self._id_at.copy_(buf[1])
            leaders.Free()
        barrier(topo.node_comm, self.timeout, what)

    # ------------------------------------------------------------------ properties and views
    def __len__(self) -> int:
        return self.shape[0]

    @property
    def num_rows(self) -> int:
        return self.shape[0]

    def host_view(self) -> torch.Tensor:
        """This node's host tier (rows in storage order; see :meth:`host_ids`)."""
        return self._host_view

    def device_view(self) -> torch.Tensor:
        """This rank's device chunk (rows in storage order; see :meth:`device_ids`)."""
        return self._device_views[self.topo.local_rank]

    def _ids_at(self, lo: int, hi: int) -> torch.Tensor:
        if self._id_at is None:
            return torch.arange(lo, hi, dtype=torch.int64)
        return self._id_at[lo:hi].clone()

    def host_ids(self) -> torch.Tensor:
        """Original row ids of :meth:`host_view`'s rows."""
        return self._ids_at(self._node_start + self._seg_starts[-1], self._node_end)

    def device_ids(self) -> torch.Tensor:
        """Original row ids of :meth:`device_view`'s rows."""
        j = self.topo.local_rank
        base = self._node_start
        return self._ids_at(base + self._seg_starts[j], base + self._seg_starts[j + 1])

    # ------------------------------------------------------------------ index handling
    def _positions(self, idx: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Validate ``idx`` and return the storage positions of its rows (flat, on the CPU)."""
        idx = _as_index(idx)
        if idx.dtype not in _INDEX_DTYPES:
            raise TypeError(f"ChunkTensor index must be an int32 or int64 tensor, got {idx.dtype}")
        if idx.dim() != 1:
            idx = idx.reshape(-1)
        if idx.device.type != "cpu":
            idx = idx.cpu()
        if idx.numel():
            lo, hi = (v.item() for v in torch.aminmax(idx))
            if lo < 0 or hi >= self.num_rows:
                bad = lo if lo < 0 else hi
                raise IndexError(f"index {bad} is out of range for a ChunkTensor of {self.num_rows} rows")
        if self._pos_of is not None:
            return self._pos_of.index_select(0, idx)
        return idx

    def _gather_node(self, lp: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows at node-local storage positions ``lp`` (all on this node), on this rank's device."""
        n = lp.numel()
        if out is None:
            out = torch.empty((n, *self.row_shape), dtype=self.dtype, device=self.device)
        if n == 0:
            return out
        starts = self._seg_starts
        views = [*self._device_views, self._host_view]
        if self._node_view is not None:  # CPU: every tier of the node is one mapping, one gather
            return self._gather_from(self._node_view, lp, out)
        lo, hi = (int(v) for v in torch.aminmax(lp))
        first = int(torch.bucketize(torch.tensor(lo), self._bounds, right=True))
        if first == len(views) - 1 or hi < starts[first + 1]:  # one tier: a single gather
            self._gather_from(views[first], lp if starts[first] == 0 else lp - starts[first], out)
            return out
        seg = torch.bucketize(lp, self._bounds, right=True)
        for k, view in enumerate(views):
            sel = (seg == k).nonzero().squeeze(1)
            if sel.numel():
                rows = self._gather_from(view, lp.index_select(0, sel) - starts[k])
                out.index_copy_(0, sel.to(out.device), rows.to(out.device))
        return out

    def _gather_from(self, view: torch.Tensor, off: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        if view.device.type == "cpu":
            if out is not None and out.device.type == "cpu":
                return torch.index_select(view, 0, off, out=out)
            rows = view.index_select(0, off)
            if out is None:
                return rows
            return out.copy_(rows, non_blocking=False)
        rows = view.index_select(0, off.to(view.device))
        if out is None:
            return rows
        return out.copy_(rows)

    def _node_of(self, pos: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(pos, self._node_edges, right=True)

    def _serve_into(self, pos: torch.Tensor, into: torch.Tensor) -> None:
        """Answer remote requests: rows at global storage positions ``pos`` (this node's) into bytes ``into``."""
        lo, hi = torch.aminmax(pos)
        if lo < self._node_start or hi >= self._node_end:
            raise RuntimeError("remote request for a row this node does not hold (inconsistent layouts)")
        self._gather_node(pos - self._node_start, self._rows_of(into))

    def _rows_of(self, raw: torch.Tensor) -> torch.Tensor:
        """A ``(n, row_bytes)`` uint8 tensor seen as ``n`` rows of this dtype and row shape."""
        return raw.view(self.dtype).view(raw.shape[0], *self.row_shape)

    def _as_bytes(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        flat = rows.contiguous().reshape(n, math.prod(self.row_shape))
        return flat.view(torch.uint8).reshape(n, self.row_bytes)

    def _gather(self, pos: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows at global storage positions ``pos``: this node's read in place, the rest fetched (collective)."""
        n = pos.numel()
        if out is None:
            out = torch.empty((n, *self.row_shape), dtype=self.dtype, device=self.device)
        if self.topo.num_nodes == 1:
            return self._gather_node(pos, out)
        if self.row_bytes == 0:  # rows of zero width: nothing to move, on every rank alike
            return out
        nodes = self._node_of(pos)
        here = nodes == self.topo.node
        n_here = int(here.sum()) if n else 0
        remote_sel = None  # positions in out of the remote rows; None: all of out
        if n_here == n:
            self._gather_node(pos - self._node_start, out)
            pos = nodes = pos[:0]
        elif n_here:
            local_sel = here.nonzero().squeeze(1)
            out.index_copy_(0, local_sel.to(out.device),
                            self._gather_node(pos.index_select(0, local_sel) - self._node_start))
            remote_sel = (~here).nonzero().squeeze(1)
            pos, nodes = pos.index_select(0, remote_sel), nodes.index_select(0, remote_sel)
        direct = (remote_sel is None and n > n_here and out.is_contiguous()
                  and out.device == self.comm_device)
        got, order = self._exchange.fetch(pos, self._dest_of_node.index_select(0, nodes), self._serve_into,
                                          self._as_bytes(out) if direct else None)
        if pos.numel() and not (direct and order is None):
            where = torch.arange(pos.numel()) if remote_sel is None else remote_sel
            if order is not None:
                where = where.index_select(0, order)
            out.index_copy_(0, where.to(out.device), self._rows_of(got).to(out.device))
        return out

    # ------------------------------------------------------------------ gathers
    def index(self, idx: torch.Tensor | Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``idx`` (int32/int64, any shape, duplicates allowed), shaped ``idx.shape + row_shape``.

        ``out`` (this dtype, on this rank's device, shaped like the result or contiguous with as
        many elements) is filled and returned instead of a new tensor, which saves allocating and
        faulting in fresh pages.

        Collective when the tensor spans several nodes (every rank calls it, the same number of
        times, with any number of ids); purely local otherwise.  On one CPU node without a hot-row
        order this is a single ``index_select`` with O(1) Python overhead.
        """
        if self._fast:
            # One node on CPU, no reordering: the node view is the whole tensor and a gather is a single
            # index_select, whose own O(1) checks (index dtype and device, out dtype) and bounds check
            # during the copy (negative ids too) stand in for a separate validation pass.  If any of
            # them fails, the general path below checks again and raises the descriptive error.
            try:
                if idx.ndim == 1:
                    if out is None:
                        return _index_select(self._node_view, 0, idx)
                    if out.shape == idx.shape + self._row_size:
                        return _index_select(self._node_view, 0, idx, out=out)
            except (AttributeError, TypeError, IndexError, RuntimeError):
                pass
        try:
            self._check_open()
            idx = _as_index(idx)
            shape = tuple(idx.shape)
            pos = self._positions(idx)
            if out is not None:
                out = self._check_out(out, pos.numel())
        except Exception as e:
            self._refuse_gather(e)  # peers in the same collective gather raise too, instead of waiting
            raise
        if self._node_view is not None and self.topo.num_nodes == 1:  # CPU, one node: one gather
            res = torch.index_select(self._node_view, 0, pos, out=out) if out is not None \
                else torch.index_select(self._node_view, 0, pos)
        else:
            res = self._gather(pos, out)
        return res if len(shape) == 1 else res.reshape(*shape, *self.row_shape)

    def _check_out(self, out: torch.Tensor, n: int) -> torch.Tensor:
        want = (n, *self.row_shape)
        if not isinstance(out, torch.Tensor) or out.dtype != self.dtype or out.device.type != self.device.type:
            got = f"{out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"out must be a {self.dtype} tensor on {self.device}, got {got}")
        if out.shape != want:
            if out.numel() != math.prod(want) or not out.is_contiguous():
                raise ValueError(f"out must be of shape {want} (or contiguous with {math.prod(want)} "
                                 f"elements), got shape {tuple(out.shape)}")
            out = out.view(want)
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ChunkTensor is closed: its shared memory is no longer mapped")

    def _refuse_gather(self, error: BaseException) -> None:
        """Join the collective gather that peers are in, telling them it failed here (multi-node only)."""
        if self._exchange is not None:
            self._exchange.fail(error)

    def __getitem__(self, idx: torch.Tensor | Sequence[int] | int | slice) -> torch.Tensor:
        if isinstance(idx, int):
            return self.index(torch.tensor([idx]))[0]
        if isinstance(idx, slice):
            return self.index(torch.arange(self.num_rows)[idx])
        return self.index(idx)

    def split_index(self, idx: torch.Tensor | Sequence[int]) -> IndexSplit:
        """Split ``idx`` by tier as seen from this rank: own device chunk, other local devices, host, remote.

        Each part gives the positions in ``idx`` and the row ids; not collective.
        """
        self._check_open()
        idx = _as_index(idx)
        pos = self._positions(idx)
        flat = idx.reshape(-1).cpu().to(torch.int64)
        nodes = self._node_of(pos)
        here = nodes == self.topo.node
        seg = torch.bucketize(pos - self._node_start, self._bounds, right=True)
        lr, host_k = self.topo.local_rank, len(self._device_views)
        masks = (here & (seg == lr), here & (seg != lr) & (seg != host_k), here & (seg == host_k), ~here)
        parts = []
        for m in masks:
            sel = m.nonzero().squeeze(1)
            parts.append(TierPart(sel, flat.index_select(0, sel)))
        return IndexSplit(*parts)

    def _tier_gather(self, idx: torch.Tensor | Sequence[int], part: str) -> torch.Tensor:
        """Gather rows that must all lie in one of this node's tiers; never collective."""
        shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else (len(idx),)
        split = self.split_index(idx)
        n = sum(p.order.numel() for p in split)
        if getattr(split, part).order.numel() != n:
            raise ValueError(f"{part}_index got ids outside the {part} tier of rank {self.topo.rank}")
        pos = self._positions(idx) - self._node_start
        return self._gather_node(pos).reshape(*shape, *self.row_shape)

    def local_index(self, idx: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Gather rows that all live in this rank's device chunk (error otherwise)."""
        return self._tier_gather(idx, "local")

    def device_index(self, idx: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Gather rows that all live in other local ranks' device chunks (error otherwise)."""
        return self._tier_gather(idx, "device")

    def host_index(self, idx: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Gather rows that all live in this node's host tier (error otherwise)."""
        return self._tier_gather(idx, "host")

    def remote_index(self, idx: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Gather rows that all live on other nodes (error otherwise); collective over the group."""
        try:
            split = self.split_index(idx)
            if split.remote.order.numel() != sum(p.order.numel() for p in split):
                raise ValueError(f"remote_index got ids that node {self.topo.node} (of {self.topo.num_nodes}) "
                                 f"holds itself, on rank {self.topo.rank}")
        except Exception as e:
            self._refuse_gather(e)  # a rank with a bad index must not leave its peers in the exchange
            raise
        return self.index(idx)

    # ------------------------------------------------------------------ loading
    def _write_node_rows(self, offset: int, rows: torch.Tensor) -> None:
        """Write ``rows`` at node-local storage offsets ``offset:offset+len(rows)``, across tiers."""
        starts = self._seg_starts
        views = [*self._device_views, self._host_view]
        end = offset + rows.shape[0]
        for k, view in enumerate(views):
            a, b = max(offset, starts[k]), min(end, starts[k + 1] if k + 1 < len(starts) else self._node_end
                                                 - self._node_start)
            if a < b:
                view[a - starts[k]:b - starts[k]].copy_(rows[a - offset:b - offset])

    def _check_source(self, shape: tuple[int, ...], what: str) -> None:
        if tuple(shape) != tuple(self.shape):
            raise ValueError(f"{what} has shape {tuple(shape)} but the ChunkTensor has shape "
                             f"{tuple(self.shape)}")

    def _step(self, what: str) -> contextlib.AbstractContextManager[None]:
        """One step of a collective method, agreed over every rank: an error on one rank raises on all (the
        others raise :class:`~torchhpc.runtime.errors.RemoteError`, also of the failing rank's builtin type)."""
        return agreed(self.topo.comm, self.timeout, what, keep_type=True)

    def load_from_tensor(self, t: torch.Tensor | None, src: int | None = 0) -> None:
        """Fill from tensor ``t`` held by rank ``src`` (``src=None``: every rank passes the same ``t``).

        Collective.  Only node leaders write; rows for other nodes go to their leaders over
        torch.distributed in bounded blocks.  A refused input leaves the tensor as it was.
        """
        what = "ChunkTensor.load_from_tensor()"
        with self._step(what):
            self._check_open()
            have = self._check_input_tensor(t, src)
        with self._step(what):  # its agreement is also the barrier after every rank's writes
            self._copy_from_tensor(t, src, have)
            self._sync_device()

    def _check_input_tensor(self, t: torch.Tensor | None, src: int | None) -> bool:
        """Refuse a bad input of :meth:`load_from_tensor` (local); whether this rank holds the source."""
        topo = self.topo
        have = src is None or topo.rank == src
        if have:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"load_from_tensor needs a tensor on rank {topo.rank}, got {type(t).__name__}")
            self._check_source(tuple(t.shape), "load_from_tensor input")
            if t.dtype != self.dtype:
                raise TypeError(f"load_from_tensor input has dtype {t.dtype} but the ChunkTensor holds "
                                f"{self.dtype}; convert it first")
        if src is not None and not 0 <= src < topo.size:
            raise ValueError(f"src={src} is not a rank of the communicator (size {topo.size})")
        return have

    def _copy_from_tensor(self, t: torch.Tensor | None, src: int | None, have: bool) -> None:
        """Write every node's rows: from ``t`` where the writer holds it, else sent by ``src`` in blocks."""
        topo, lay = self.topo, self.layout
        block = max(1, _LOAD_BLOCK_BYTES // max(self.row_bytes, 1))
        src_node = None if src is None else next(n for n, r in enumerate(topo.node_ranks) if src in r)
        for n in range(topo.num_nodes):
            lo, hi = lay.node_starts[n], lay.node_starts[n + 1]
            leader = topo.node_ranks[n][0]
            writer = leader if src is None or src_node != n else src
            if topo.rank not in (writer, src):
                continue
            for a in range(lo, hi, block):
                self._copy_block(t, src, have, writer, leader, a, min(hi, a + block), lo)

    def _copy_block(self, t: torch.Tensor | None, src: int | None, have: bool, writer: int, leader: int,
                    a: int, b: int, lo: int) -> None:
        """Storage positions ``a:b`` of a node starting at ``lo``: written here, sent to its leader, or received."""
        what = f"ChunkTensor.load_from_tensor() rows {a}:{b} from rank {src}"
        if self.topo.rank == writer and have:
            rows = t.index_select(0, self._ids_at(a, b).to(t.device)).cpu()
            self._write_node_rows(a - lo, rows)
        elif self.topo.rank == src:
            rows = t.index_select(0, self._ids_at(a, b).to(t.device)).contiguous()
            payload = self._as_bytes(rows).to(self.comm_device)
            wait_works([dist.isend(payload, dst=leader, group=self.group)], self.timeout, what)
        else:  # the writer, fed by src
            payload = torch.empty((b - a, self.row_bytes), dtype=torch.uint8, device=self.comm_device)
            wait_works([dist.irecv(payload, src=src, group=self.group)], self.timeout, what)
            rows = payload.cpu().view(self.dtype).reshape(b - a, *self.row_shape)
            self._write_node_rows(a - lo, rows)

    def load_from_file(self, source: str | Path | np.ndarray) -> None:
        """Fill from a ``.npy`` file, a raw binary file (C order, this dtype) or a (memory-mapped) array.

        Collective.  Each local rank copies its share of its node's rows straight from the memory
        map in bounded blocks, so no process ever holds the whole tensor.  A file must be
        readable at the same path on every node; bfloat16 data is read as uint16 bit patterns.
        """
        what = "ChunkTensor.load_from_file()"
        with self._step(what):
            self._check_open()
            arr = self._open_source(source)
        with self._step(what):  # its agreement is also the barrier after every rank's writes
            self._copy_from_array(arr)
            self._sync_device()

    def _open_source(self, source: str | Path | np.ndarray) -> np.ndarray:
        """``source`` as a (memory-mapped) array of this tensor's shape and dtype, or an error (local)."""
        if isinstance(source, np.ndarray):
            arr = source
        else:
            path = Path(source)
            if path.suffix == ".npy":
                arr = np.load(path, mmap_mode="r")
            else:
                arr = np.memmap(path, dtype=_NUMPY_DTYPES[self.dtype], mode="r", shape=tuple(self.shape))
        name = "array" if isinstance(source, np.ndarray) else str(source)
        self._check_source(arr.shape, f"source {name}")
        want = np.dtype(_NUMPY_DTYPES[self.dtype])
        if arr.dtype != want:
            raise TypeError(f"source holds {arr.dtype} but the ChunkTensor holds {self.dtype} "
                            f"(needs numpy {want})")
        return arr

    def _copy_from_array(self, arr: np.ndarray) -> None:
        """This local rank's share of its node's rows, from ``arr`` in bounded blocks (local)."""
        topo, lay = self.topo, self.layout
        lo, hi = lay.node_starts[topo.node], lay.node_starts[topo.node + 1]
        share = -(-(hi - lo) // topo.local_size)
        my_lo, my_hi = min(hi, lo + topo.local_rank * share), min(hi, lo + (topo.local_rank + 1) * share)
        block = max(1, _LOAD_BLOCK_BYTES // max(self.row_bytes, 1))
        for a in range(my_lo, my_hi, block):
            b = min(my_hi, a + block)
            if self._id_at is None:
                chunk = np.array(arr[a:b])  # one bounded block, writable
            else:
                ids = self._ids_at(a, b).numpy()
                srt = np.argsort(ids, kind="stable")
                chunk = np.empty((b - a, *arr.shape[1:]), dtype=arr.dtype)
                chunk[srt] = arr[ids[srt]]  # sorted reads from the file, then back to storage order
            rows = torch.from_numpy(chunk)
            if self.dtype == torch.bfloat16:
                rows = rows.view(torch.bfloat16)
            self._write_node_rows(a - lo, rows)

    def _sync_device(self) -> None:
        if self.use_cuda:
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ reporting and lifecycle
    def memory_report(self) -> MemoryReport:
        """Bytes per tier per rank and per node (collective over the communicator)."""
        topo, lay = self.topo, self.layout
        me = {"rank": topo.rank, "node": topo.node,
              "device_bytes": lay.device_rows[topo.node][topo.local_rank] * self.row_bytes,
              "host_bytes_mapped": lay.host_rows(topo.node) * self.row_bytes,
              "exchange_buffer_bytes": 0 if self._exchange is None else self._exchange.buffer_bytes}
        per_rank = allgather_object(topo.comm, me, self.timeout, "ChunkTensor.memory_report()")
        per_node = []
        for n in range(topo.num_nodes):
            dev = sum(lay.device_rows[n]) * self.row_bytes
            host = lay.host_rows(n) * self.row_bytes
            per_node.append({"node": n, "device_bytes": dev, "host_bytes": host, "total_bytes": dev + host})
        return MemoryReport(per_rank, per_node)

    def close(self) -> None:
        """Drop this rank's mappings (not collective); the memory is freed when the last rank lets go."""
        if getattr(self, "_registered", None):
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        self._fast = False
        self._closed = True
        self._node_view = None
        self._device_views = []
        self._host_view = None  # type: ignore[assignment]
        self._pos_of = self._id_at = None
        self._ipc_keep = []
        if getattr(self, "_exchange", None) is not None:
            self._exchange.close()
        for s in getattr(self, "_segments", []):
            s.close()
        self._segments = []

    def __enter__(self) -> ChunkTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        lay, node = self.layout, self.topo.node
        return (f"ChunkTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"node {node}/{self.topo.num_nodes}, "
                f"device rows {lay.device_rows[node]}, host rows {lay.host_rows(node)})")
