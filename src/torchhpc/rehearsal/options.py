"""Settings of a :class:`~torchhpc.rehearsal.RehearsalBuffer`: what it stores, how it samples, how it waits.

``RehearsalBuffer(options=RehearsalOptions(...))`` and the constructor's keywords are two spellings of the
same settings: keywords given (not ``None``) override the options' fields (:meth:`RehearsalOptions.resolve`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["RehearsalOptions", "TASKS", "MODES", "TRANSPORTS", "PROTOCOLS", "sample_shapes_of"]

TASKS = ("rehearsal", "kd", "rehearsal+kd")
MODES = ("standard", "flyweight")
TRANSPORTS = ("auto", "mpi", "thallium")
# Mercury protocols: shared memory on one node; libfabric TCP, InfiniBand verbs, HPE Slingshot across nodes.
PROTOCOLS = ("na+sm", "ofi+tcp", "ofi+verbs", "ofi+cxi")

# name, lowest value: settings that must be integers
_COUNTS = (("num_classes", 1), ("slots_per_class", 1), ("num_candidates", 1), ("num_representatives", 0),
           ("max_pending", 1), ("worker_niceness", 0))


def sample_shapes_of(sample_shapes: Any) -> list[tuple[int, ...]]:
    """Normalise ``(3, 32, 32)`` or ``[(3, 32, 32), (1, 32, 32)]`` to a list of shape tuples."""
    if isinstance(sample_shapes, torch.Size) or (
        isinstance(sample_shapes, Sequence) and all(isinstance(s, int | np.integer) for s in sample_shapes)
    ):
        shapes = [tuple(int(s) for s in sample_shapes)]
    elif isinstance(sample_shapes, Sequence) and len(sample_shapes) > 0:
        shapes = [tuple(int(s) for s in shape) for shape in sample_shapes]
    else:
        raise ValueError(f"sample_shapes must be a shape or a list of shapes, not {sample_shapes!r}")
    for shape in shapes:
        if any(s < 1 for s in shape):
            raise ValueError(f"sample shape {shape} has a non-positive dimension")
    return shapes


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


@dataclass
class RehearsalOptions:
    """Every setting of a rehearsal buffer; :meth:`validate` checks them without MPI or devices.

    - ``num_classes``: ``K``, number of classes (1 for reconstruction tasks).
    - ``slots_per_class``: ``N``, slots per class on each rank.
    - ``num_candidates``: ``C``, samples of each new minibatch offered to the reservoir.
    - ``num_representatives``: ``R``, representatives added to each minibatch.
    - ``sample_shapes``: per-sample shape, or a list of shapes when one representative is several tensors.
    - ``task``: ``"rehearsal"`` (samples + labels), ``"kd"`` (also activations; representatives carry loss
      weight 0 for the label loss: Dark Experience Replay uses only their stored activations) or
      ``"rehearsal+kd"`` (both, DER++).
    - ``activation_shape``: per-sample activation shape, required by the ``kd`` tasks (else ``None``).
    - ``device``: where ``wait()`` puts its tensors (``"cpu"`` or a CUDA device).
    - ``global_sampling``: draw from all ranks' buffers (one-sided reads) or only the local one.
    - ``seed``: base seed (each rank derives its own stream); ``None`` for OS entropy.
    - ``sample_dtypes``: dtype of the samples (one, or one per sample tensor).
    - ``activation_dtype``: dtype of the activations.
    - ``mode``: ``"standard"`` (``wait()`` returns new samples + representatives) or ``"flyweight"``
      (representatives only, written into the ``out`` tensors given to ``accumulate()``).
    - ``rehearsal_weight``: loss weight of representatives (new samples weigh 1).
    - ``progress_interval``: seconds between MPI progress polls of the idle worker, for MPI transports that
      need the owner's progress to serve one-sided reads; ``None`` polls every 2 ms only when the ranks span
      several nodes, 0 never polls.
    - ``timeout``: seconds ``wait()`` waits for the worker, and the constructor's error agreement and
      ``close()`` wait for the peers, before raising :class:`~torchhpc.runtime.errors.PeerTimeoutError`.
    - ``max_pending``: most ``accumulate()`` calls allowed ahead of ``wait()``.
    - ``worker_niceness``: nice value (0-19, Linux) of the worker thread alone, so that the training threads
      of all ranks on a node win the cores when they need them: the worker's work is off the critical path,
      a training thread late to the gradient all-reduce is on every rank's.  0 leaves the worker as it is.
    - ``start_delay``: seconds the worker holds a new batch back before working on it, unless ``wait()`` asks
      for it sooner: the first moments after a hand-over are when the training thread starts its step.
    - ``transport``: how representatives are read from other ranks: ``"mpi"`` (one-sided MPI RMA reads of a
      window), ``"thallium"`` (Mochi Thallium RPC + bulk transfers served by each owner's Argobots
      progress; needs ``make native-mochi``, else :class:`~torchhpc.runtime.errors.EngineUnavailableError`), or
      ``"auto"`` (default): Thallium when the job spans nodes and every rank has it built, MPI otherwise
      (across TCP nodes Thallium fetched 1.5-2.5x faster than MPI's one-sided reads; on one node shared
      memory is faster).  Without ``global_sampling`` nothing is read remotely and neither is set up.
    - ``protocol``: the Thallium (Mercury) protocol: ``"na+sm"`` (one node), ``"ofi+tcp"``, ``"ofi+verbs"``
      or ``"ofi+cxi"`` (across nodes); ``None`` picks ``na+sm`` when all ranks share a node, else
      ``ofi+tcp``.  Only with ``transport="thallium"``.
    """

    num_classes: int
    slots_per_class: int
    num_candidates: int
    num_representatives: int
    sample_shapes: Sequence[int] | Sequence[Sequence[int]]
    task: str = "rehearsal"
    activation_shape: Sequence[int] | None = None
    device: str | torch.device = "cpu"
    global_sampling: bool = True
    seed: int | None = None
    sample_dtypes: torch.dtype | Sequence[torch.dtype] = torch.float32
    activation_dtype: torch.dtype = torch.float32
    mode: str = "standard"
    rehearsal_weight: float = 1.0
    progress_interval: float | None = None
    timeout: float = 600.0
    max_pending: int = 4
    worker_niceness: int = 10
    start_delay: float = 0.002
    transport: str = "auto"
    protocol: str | None = None

    @classmethod
    def resolve(cls, options: RehearsalOptions | None, **given: Any) -> RehearsalOptions:
        """``options`` (or the defaults) with every setting in ``given`` that is not ``None`` put in its place."""
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"options must be a {cls.__name__}, got {type(options).__name__}")
        chosen = {k: v for k, v in given.items() if v is not None}
        if options is None:
            missing = [f.name for f in dataclasses.fields(cls)
                       if f.default is dataclasses.MISSING and f.name not in chosen]
            if missing:
                raise TypeError(f"RehearsalBuffer needs {', '.join(missing)} (or options=RehearsalOptions(...))")
            return cls(**chosen)
        return dataclasses.replace(options, **chosen)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """``sample_shapes`` as a list of shape tuples."""
        return sample_shapes_of(self.sample_shapes)

    @property
    def multi(self) -> bool:
        """Whether a representative is several tensors (``sample_shapes`` is a list of shapes)."""
        s = self.sample_shapes
        return not (isinstance(s, torch.Size) or all(isinstance(d, int | np.integer) for d in s))

    @property
    def dtypes(self) -> list[torch.dtype]:
        """One sample dtype per sample tensor."""
        if isinstance(self.sample_dtypes, torch.dtype):
            return [self.sample_dtypes] * len(self.shapes)
        return list(self.sample_dtypes)

    @property
    def stores_activations(self) -> bool:
        return self.task != "rehearsal"

    def validate(self) -> None:
        """Raise ValueError (TypeError for a wrong type) naming the first bad setting."""
        _check_choice("transport", self.transport, TRANSPORTS)
        if self.protocol is not None:
            if self.transport != "thallium":
                raise ValueError(f"protocol={self.protocol!r} applies to transport='thallium' only")
            if self.protocol not in PROTOCOLS:
                raise ValueError(f"protocol must be one of {PROTOCOLS} (or None), got {self.protocol!r}")
        _check_choice("task", self.task, TASKS)
        _check_choice("mode", self.mode, MODES)
        for name, low in _COUNTS:
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.worker_niceness > 19:
            raise ValueError(f"worker_niceness must be in [0, 19], got {self.worker_niceness}")
        if self.stores_activations and self.activation_shape is None:
            raise ValueError(f"task {self.task!r} stores activations: give activation_shape")
        if not self.stores_activations and self.activation_shape is not None:
            raise ValueError("activation_shape given but task 'rehearsal' stores no activations")
        if len(self.dtypes) != len(self.shapes):
            raise ValueError(f"{len(self.dtypes)} sample_dtypes for {len(self.shapes)} sample tensors")
        if torch.device(self.device).type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        self._validate_seconds()

    def _validate_seconds(self) -> None:
        for name in ("start_delay", "timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if self.progress_interval is not None and not self.progress_interval >= 0:
            raise ValueError(f"progress_interval must be >= 0 seconds or None, got {self.progress_interval!r}")
