"""One rank's slot storage, optionally exposed to every other rank through an MPI RMA window.

The storage is one contiguous byte block (header + K*N records, see :mod:`.layout`),
allocated once.  With a window it is allocated by MPI (``MPI_Win_allocate``), which lets
the MPI library place it where peers read it without the owner's help (shared memory on a
node, registered memory for RDMA across nodes).

Consistency: the owner rewrites records and the fill counts only inside an exclusive
passive-target lock on its own window; readers fetch inside a shared lock on each peer.  MPI makes
exclusive-lock epochs mutually exclusive with every other lock epoch on that target, so a
reader sees a record either wholly before or wholly after an update: a sample can never
come back paired with another sample's label or activation.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from .layout import RecordLayout

__all__ = ["SlotStorage"]


class SlotStorage:
    """Preallocated storage of one rank plus the one-sided reads of the other ranks' storage."""

    def __init__(
        self, layout: RecordLayout, comm: MPI.Comm | None, pin: bool
    ) -> None:
        self.layout = layout
        self._field_spans = [(f.name, f.offset, f.nbytes) for f in layout.fields]  # plain ints, computed once
        self.comm = comm
        self.win: MPI.Win | None = None
        self._registered_ptr: int | None = None
        if comm is not None:
            self.win = MPI.Win.Allocate(layout.total_bytes, disp_unit=1, comm=comm)
            mem = self.win.tomemory()
            self.bytes = torch.frombuffer(mem, dtype=torch.uint8, count=layout.total_bytes)
            if pin:
                self._pin(self.bytes)
            self.rank = comm.Get_rank()
            self.size = comm.Get_size()
            self._peers = [r for r in range(self.size) if r != self.rank]  # every rank but this one, in order
        else:
            self.bytes = torch.empty(layout.total_bytes, dtype=torch.uint8, pin_memory=pin)
            self.rank, self.size = 0, 1
            self._peers = []
        self.bytes.zero_()
        self.fills = layout.fills(self.bytes)
        self.labels = layout.view(self.bytes, layout.label)
        self.samples = [layout.view(self.bytes, f) for f in layout.samples]
        self.activations = layout.view(self.bytes, layout.activation) if layout.activation else None
        if self.win is not None:
            self.comm.Barrier()  # every window zeroed before anyone may read it

    @property
    def remote(self) -> bool:
        """Whether peers' storage can be read (a transport is set up)."""
        return self.win is not None

    def _lock_exclusive(self) -> None:
        """Exclude every reader of this rank's records (the owner's updates)."""
        if self.win is not None:
            self.win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)

    def _unlock_exclusive(self) -> None:
        if self.win is not None:
            self.win.Unlock(self.rank)

    def _pin(self, t: torch.Tensor) -> None:
        """Page-lock MPI-allocated memory so host-to-GPU copies from it are asynchronous DMA."""
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the rehearsal storage failed (error {int(err)})")
        self._registered_ptr = t.data_ptr()

    # ---------------------------------------------------------------- updates (owner only)
    def write(
        self,
        flat_slots: np.ndarray,
        labels: np.ndarray,
        rows: np.ndarray,
        samples: list[torch.Tensor],
        activations: torch.Tensor | None,
        fills: np.ndarray,
    ) -> None:
        """Store row ``rows[i]`` of the batch in record ``flat_slots[i]``; publish ``fills``; one exclusive epoch.

        CPU rows are copied straight into their records (one copy); GPU rows are gathered on
        the device and brought over in one transfer per tensor first.
        """
        sources = list(samples) + ([activations] if activations is not None else [])
        targets = list(self.samples) + ([self.activations] if activations is not None else [])
        index = torch.from_numpy(rows)
        host = [s.index_select(0, index.to(s.device)).cpu() if s.device.type != "cpu" else s for s in sources]
        host_rows = [np.arange(len(rows)) if s.device.type != "cpu" else rows for s in sources]
        self._lock_exclusive()
        try:
            if len(flat_slots):
                self.labels.index_copy_(0, torch.from_numpy(flat_slots), torch.from_numpy(labels))
                for dst, src, src_rows in zip(targets, host, host_rows, strict=True):
                    for slot, row in zip(flat_slots.tolist(), src_rows.tolist(), strict=True):
                        dst[slot].copy_(src[row])
            self.fills.copy_(torch.from_numpy(fills))
        finally:
            self._unlock_exclusive()

    def load(self, raw: torch.Tensor) -> None:
        """Replace the whole storage (a restored checkpoint) in one exclusive epoch."""
        self._lock_exclusive()
        try:
            self.bytes.copy_(raw)
        finally:
            self._unlock_exclusive()

    # ---------------------------------------------------------------- reads
    def read_local(self, flat_slots: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        """Copy local records into the rows of ``out`` (keys: label, sample<i>, activation)."""
        torch.index_select(self.labels, 0, flat_slots, out=out["label"])
        for i, src in enumerate(self.samples):
            torch.index_select(src, 0, flat_slots, out=out[f"sample{i}"])
        if self.activations is not None:
            torch.index_select(self.activations, 0, flat_slots, out=out["activation"])

    def begin_remote(self) -> None:
        """Open a shared access epoch on every other rank (blocks those owners' updates only while it lasts).

        One shared ``Lock`` per peer, not ``Lock_all``: Open MPI's ``osc/rdma`` (the transport
        across nodes) implements ``Lock_all`` as one count at a leader rank that any exclusive
        lock anywhere must find empty, so every owner's update would wait for every reader in
        the job, and readers and writers retrying against each other's counts livelocked for
        minutes on two nodes.  Per-peer locks keep each owner's exclusion to its own readers.
        """
        assert self.win is not None
        for r in self._peers:
            self.win.Lock(r, MPI.LOCK_SHARED)

    def end_remote(self) -> None:
        assert self.win is not None
        for r in self._peers:
            self.win.Unlock(r)

    def remote_fills(self, ranks: list[int]) -> np.ndarray:
        """Fill counts of ``ranks`` (inside :meth:`begin_remote`); shape ``(len(ranks), K)``."""
        assert self.win is not None
        k = self.layout.num_classes
        out = np.empty((len(ranks), k), dtype=np.int64)
        for i, r in enumerate(ranks):
            self.win.Get(out[i], r, target=(0, 8 * k, MPI.BYTE))
        self.flush()
        return out

    def remote_read(self, ranks: np.ndarray, flat_slots: np.ndarray, out: dict[str, np.ndarray]) -> int:
        """Fetch record ``flat_slots[i]`` of rank ``ranks[i]`` into row ``i`` of ``out``, for every ``i`` not ours.

        ``out`` maps field names to C-contiguous ``(rows, field bytes)`` uint8 arrays (views of
        the output tensors).  One plain ``MPI_Get`` per record and field, straight into its
        row: no staging copy, and no derived datatype (a per-peer indexed target datatype
        reading every wanted record at once was markedly slower than plain Gets under Open
        MPI's ``osc/sm``).  Must be called inside :meth:`begin_remote`; completion is left to the caller's
        :meth:`flush`.  Returns the bytes requested.
        """
        assert self.win is not None
        lay, get, me = self.layout, self.win.Get, self.rank
        fields = [(out[name], offset, nbytes) for name, offset, nbytes in self._field_spans if name in out]
        bases = (lay.header_bytes + flat_slots.astype(np.int64) * lay.record_bytes).tolist()
        total = 0
        for row, (rank, base) in enumerate(zip(ranks.tolist(), bases, strict=True)):
            if rank == me:
                continue
            for dst, offset, nbytes in fields:
                get(dst[row], rank, target=(base + offset, nbytes, MPI.BYTE))
                total += nbytes
        return total

    def flush(self) -> None:
        """Complete every read issued in this epoch.

        ``Flush`` per peer, not ``Flush_all``: in Open MPI 5's ``osc/rdma`` (up to at least
        5.0.11) ``Flush_all`` completes only ``Lock_all`` epochs and per-target locks kept in
        its hash table, which jobs smaller than its array threshold do not use: it returned
        at once and the fill counts read behind it were still garbage.
        """
        assert self.win is not None
        for r in self._peers:
            self.win.Flush(r)

    def free(self) -> None:
        """Release the window (collective when windowed) and any page-locking."""
        if self._registered_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            self._registered_ptr = None
        self.fills = self.labels = self.activations = None  # type: ignore[assignment]
        self.samples = []
        self.bytes = None  # type: ignore[assignment]
        if self.win is not None:
            self.win.Free()
            self.win = None
