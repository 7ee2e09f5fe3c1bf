"""Distributed asynchronous rehearsal buffers for data-parallel continual learning.

:class:`RehearsalBuffer` keeps per-class reservoir samples on every rank and mixes
representatives drawn uniformly from all ranks (one-sided MPI reads, or Thallium RPC + bulk
transfers with ``transport="thallium"``) into each new
minibatch, in a background thread; :class:`RehearsalLoader` wraps a DataLoader with it.
:class:`RehearsalOptions` holds a buffer's settings.
"""

from .buffer import STAGES, TASKS, TRANSPORTS, AugmentedBatch, RehearsalBuffer
from .loader import RehearsalLoader, spare_rows_collate
from .options import RehearsalOptions
from .reservoir import ClassReservoir

__all__ = [
    "AugmentedBatch", "ClassReservoir", "RehearsalBuffer", "RehearsalLoader", "RehearsalOptions", "STAGES", "TASKS",
    "TRANSPORTS", "spare_rows_collate",
]
