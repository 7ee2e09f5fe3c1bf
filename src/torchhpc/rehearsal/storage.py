"""One rank's slot storage, optionally exposed to every other rank through an MPI RMA window.

The storage is one contiguous byte block (header + K*N records, see :mod:`.layout`),
allocated once.  With a window it is allocated by MPI (``MPI_Win_allocate``), which lets
the MPI library place it where peers read it without the owner's help (shared memory on a
node, registered memory for RDMA across nodes).

Consistency: the owner rewrites records and the fill counts only inside an exclusive
passive-target lock on its own window; readers fetch inside a shared lock.  MPI makes
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


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A writable numpy uint8 view of a contiguous CPU tensor (any dtype), for MPI buffers."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("MPI transfers need a contiguous CPU tensor")
    return t.view(-1).view(torch.uint8).numpy()


class SlotStorage:
    """Preallocated storage of one rank plus the one-sided reads of the other ranks' storage."""

    def __init__(
        self, layout: RecordLayout, comm: MPI.Comm | None, pin: bool
    ) -> None:
        self.layout = layout
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
        else:
            self.bytes = torch.empty(layout.total_bytes, dtype=torch.uint8, pin_memory=pin)
            self.rank, self.size = 0, 1
        self.bytes.zero_()
        self.fills = layout.fills(self.bytes)
        self.labels = layout.view(self.bytes, layout.label)
        self.samples = [layout.view(self.bytes, f) for f in layout.samples]
        self.activations = layout.view(self.bytes, layout.activation) if layout.activation else None
        if self.win is not None:
            self.comm.Barrier()  # every window zeroed before anyone may read it

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
        flat_slots: torch.Tensor,
        labels: torch.Tensor,
        samples: list[torch.Tensor],
        activations: torch.Tensor | None,
        fills: np.ndarray,
    ) -> None:
        """Write records ``flat_slots`` and publish the new per-class ``fills``, as one exclusive epoch."""
        if self.win is not None:
            self.win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
        try:
            if flat_slots.numel():
                self.labels.index_copy_(0, flat_slots, labels)
                for dst, src in zip(self.samples, samples, strict=True):
                    dst.index_copy_(0, flat_slots, src)
                if self.activations is not None and activations is not None:
                    self.activations.index_copy_(0, flat_slots, activations)
            self.fills.copy_(torch.from_numpy(fills))
        finally:
            if self.win is not None:
                self.win.Unlock(self.rank)

    def load(self, raw: torch.Tensor) -> None:
        """Replace the whole storage (a restored checkpoint) in one exclusive epoch."""
        if self.win is not None:
            self.win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
        try:
            self.bytes.copy_(raw)
        finally:
            if self.win is not None:
                self.win.Unlock(self.rank)

    # ---------------------------------------------------------------- reads
    def read_local(self, flat_slots: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        """Copy local records into the rows of ``out`` (keys: label, sample<i>, activation)."""
        torch.index_select(self.labels, 0, flat_slots, out=out["label"])
        for i, src in enumerate(self.samples):
            torch.index_select(src, 0, flat_slots, out=out[f"sample{i}"])
        if self.activations is not None:
            torch.index_select(self.activations, 0, flat_slots, out=out["activation"])

    def begin_remote(self) -> None:
        """Open a shared access epoch on every rank (blocks owners' updates only while it lasts)."""
        assert self.win is not None
        self.win.Lock_all()

    def end_remote(self) -> None:
        assert self.win is not None
        self.win.Unlock_all()

    def remote_fills(self, ranks: list[int]) -> np.ndarray:
        """Fill counts of ``ranks`` (inside :meth:`begin_remote`); shape ``(len(ranks), K)``."""
        assert self.win is not None
        k = self.layout.num_classes
        out = np.empty((len(ranks), k), dtype=np.int64)
        for i, r in enumerate(ranks):
            self.win.Get(out[i], r, target=(0, 8 * k, MPI.BYTE))
        self.win.Flush_all()
        return out

    def remote_read(self, rank: int, flat_slots: np.ndarray, out: dict[str, torch.Tensor]) -> int:
        """Fetch records ``flat_slots`` of ``rank`` straight into the contiguous rows ``out`` (no staging).

        One ``MPI_Get`` per field, whose target datatype picks that field out of every wanted
        record.  Completion is left to the caller's ``Flush_all``.  Returns the bytes requested.
        """
        assert self.win is not None
        lay = self.layout
        base = lay.header_bytes + flat_slots.astype(np.int64) * lay.record_bytes
        total = 0
        for field in lay.fields:
            if field.name not in out:
                continue
            ttype = MPI.BYTE.Create_hindexed_block(field.nbytes, (base + field.offset).tolist()).Commit()
            try:
                self.win.Get(_host_bytes(out[field.name]), rank, target=(0, 1, ttype))
            finally:
                ttype.Free()
            total += field.nbytes * len(flat_slots)
        return total

    def flush(self) -> None:
        assert self.win is not None
        self.win.Flush_all()

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
