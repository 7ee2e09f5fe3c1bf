"""Settings of a :class:`~torchhpc.chunkstore.ChunkTensor`: where its rows go and how long it waits for peers.

``ChunkTensor(shape, dtype, options=ChunkStoreOptions(...))`` and the constructor's keywords are two spellings of
the same settings: keywords given (not ``None``) override the options' fields (:meth:`ChunkStoreOptions.resolve`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["ChunkStoreOptions", "DEFAULT_TIMEOUT", "ROW_TRANSPORTS"]

ROW_TRANSPORTS = ("mpi", "group")
"""How a cross-node gather's host rows may travel (:attr:`ChunkStoreOptions.row_transport`)."""

DEFAULT_TIMEOUT = 600.0
"""Seconds a collective step of a ChunkTensor waits for its peers by default."""


@dataclass
class ChunkStoreOptions:
    """How a ChunkTensor places its rows and waits; :meth:`validate` checks them without MPI.

    - ``capacity_per_device``: bytes of each rank's device tier; the node's other rows go to its shared host
      tier (0: every row there).  A whole float such as ``1e9`` is taken as that many bytes.
    - ``ranks_per_node``: blocks of this many consecutive ranks count as one node, overriding the
      shared-memory detection (``None``: ``$TORCHHPC_RANKS_PER_NODE`` if set, else MPI's; see
      :func:`~torchhpc.chunkstore.node_topology`).
    - ``use_cuda``: device chunks in GPU memory (``None``: when CUDA is available).
    - ``timeout``: seconds a collective step (construction, loading, reports, cross-node gathers) waits
      for its peers; past it :class:`~torchhpc.runtime.errors.PeerTimeoutError` (a ``TimeoutError``) is raised.
    - ``row_transport``: how a cross-node gather's host rows travel: ``"mpi"`` (``MPI_Ialltoallv`` over the
      ChunkTensor's communicator, the default: 1.4-2.5x gloo's rate across a 10 Gbit/s link) or ``"group"``
      (``all_to_all_single`` over the torch.distributed group, through whatever backend it has).  With an
      NCCL group rows always go over the group, GPU to GPU.
    """

    capacity_per_device: int = 0
    ranks_per_node: int | None = None
    use_cuda: bool | None = None
    timeout: float = DEFAULT_TIMEOUT
    row_transport: str = "mpi"

    @classmethod
    def resolve(cls, options: ChunkStoreOptions | None, **given: Any) -> ChunkStoreOptions:
        """``options`` (or the defaults) with every setting in ``given`` that is not ``None`` put in its place."""
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"options must be a {cls.__name__}, got {type(options).__name__}")
        chosen = {k: v for k, v in given.items() if v is not None}
        return dataclasses.replace(options, **chosen) if options is not None else cls(**chosen)

    @property
    def capacity_bytes(self) -> int:
        """``capacity_per_device`` as an int (after :meth:`validate`)."""
        return int(self.capacity_per_device)

    def agreement_timeout(self) -> float:
        """Deadline of the constructor's error agreement: ``timeout`` if valid, else the default (a bad
        ``timeout`` is then itself the error the ranks agree on)."""
        t = self.timeout
        return float(t) if isinstance(t, int | float) and t > 0 else DEFAULT_TIMEOUT

    def validate(self) -> None:
        """Raise TypeError or ValueError naming the first bad setting."""
        cap = self.capacity_per_device
        if isinstance(cap, bool) or not (isinstance(cap, int) or (isinstance(cap, float) and cap.is_integer())):
            raise TypeError(f"capacity_per_device is a number of bytes (int), got {cap!r}")
        if cap < 0:
            raise ValueError(f"capacity_per_device must be >= 0 bytes, got {cap}")
        if self.ranks_per_node is not None and not self.ranks_per_node >= 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if not isinstance(self.timeout, int | float) or not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.row_transport not in ROW_TRANSPORTS:
            raise ValueError(f"row_transport must be one of {ROW_TRANSPORTS}, got {self.row_transport!r}")
