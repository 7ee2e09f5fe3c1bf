"""``RehearsalBuffer``: a distributed rehearsal buffer updated and sampled by a background worker.

Each rank keeps ``num_classes x slots_per_class`` slots filled by per-class reservoir
sampling from its own stream.  ``accumulate(batch)`` hands a minibatch to the worker and
returns at once; the worker draws up to ``R`` representatives uniformly from the global
buffer (one-sided MPI reads of the other ranks' storage), builds the augmented batch, and
offers ``C`` random candidates of the new batch to the reservoir.  ``wait()`` returns the
augmented batch.  Representatives are always drawn before the batch's own update, so a
batch is never rehearsed with itself.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from mpi4py import MPI

from ..errors import PeerTimeoutError
from ..waiting import agreed
from .layout import RecordLayout
from .reservoir import ClassReservoir
from .sampler import draw_representatives
from .storage import SlotStorage
from .thallium import PROTOCOLS, ThalliumSlotStorage, default_protocol

__all__ = ["AugmentedBatch", "RehearsalBuffer", "TASKS", "STAGES", "TRANSPORTS"]

TASKS = ("rehearsal", "kd", "rehearsal+kd")
TRANSPORTS = ("mpi", "thallium")
STAGES = ("sampling", "remote_fetch", "copy", "update")
_STATE_FORMAT = 1
# The worker copies the new samples into the augmented batch in pieces of this size and offers
# the core to other threads between them (see RehearsalBuffer's worker_niceness).
_COPY_CHUNK = 4 << 20
_yield_core = getattr(os, "sched_yield", lambda: time.sleep(0))  # POSIX; elsewhere a bare GIL release
_POOL_SIZE = 4  # recycled output batches: one being filled, one in training, slack for a held reference


def _storage_refs(t: torch.Tensor) -> int:
    """How many tensors (and other holders) share ``t``'s memory; a view or numpy array adds one."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _is_prefix(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether ``src`` is exactly the first rows of ``dst`` (same memory, same layout)."""
    return (
        src.device == dst.device
        and src.data_ptr() == dst.data_ptr()
        and src.dtype == dst.dtype
        and src.is_contiguous()
        and dst.is_contiguous()
    )


def _no_refs(t: torch.Tensor) -> int:
    return -1


if not hasattr(torch._C, "_storage_Use_Count"):  # private torch API: without it, never recycle
    _storage_refs = _no_refs  # noqa: F811


class AugmentedBatch(NamedTuple):
    """What :meth:`RehearsalBuffer.wait` returns.

    ``samples`` is a tensor, or a list of tensors for multi-tensor representatives.  In
    standard mode the rows are the new samples followed by the representatives; in
    flyweight mode they are the representatives only.  ``weights`` are per-sample loss
    weights; ``activations`` is ``None`` unless the task stores them.
    """

    samples: torch.Tensor | list[torch.Tensor]
    targets: torch.Tensor
    weights: torch.Tensor
    activations: torch.Tensor | None


class _Request(NamedTuple):
    samples: list[torch.Tensor]
    targets: torch.Tensor
    activations: torch.Tensor | None
    out: AugmentedBatch | None
    seq: int  # 0 for the first accumulate() of the buffer, then 1, 2, ...


def _as_shapes(sample_shapes: Any) -> list[tuple[int, ...]]:
    """Normalise ``(3, 32, 32)`` or ``[(3, 32, 32), (1, 32, 32)]`` to a list of shape tuples."""
    if isinstance(sample_shapes, torch.Size) or (
        isinstance(sample_shapes, Sequence) and all(isinstance(s, int) for s in sample_shapes)
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


def _check_launcher(rank: int, size: int) -> None:
    """Refuse a job whose launcher started more processes than MPI connects (e.g. torchrun, no mpiexec).

    Each process would then be an MPI world of its own and "global" sampling would silently
    stay local.
    """
    from torchhpc.launcher import world_info

    info = world_info()
    if (info.world_size, info.rank) != (size, rank):
        raise RuntimeError(
            f"the launcher ({info.launcher}) says rank {info.rank} of {info.world_size} but MPI.COMM_WORLD "
            f"is rank {rank} of {size}: global sampling needs the ranks connected by MPI (start the job "
            "with mpiexec/srun), or pass global_sampling=False or an explicit comm"
        )


class RehearsalBuffer:
    """A rehearsal buffer distributed over the ranks of ``comm``, maintained in the background.

    Args:
        num_classes: ``K``, number of classes (1 for reconstruction tasks).
        slots_per_class: ``N``, slots per class on each rank.
        num_candidates: ``C``, samples of each new minibatch offered to the reservoir.
        num_representatives: ``R``, representatives added to each minibatch.
        sample_shapes: per-sample shape, or a list of shapes when one representative is several tensors.
        task: ``"rehearsal"`` (samples + labels), ``"kd"`` (also activations; representatives
            carry loss weight 0 for the label loss: Dark Experience Replay uses only their
            stored activations) or ``"rehearsal+kd"`` (both, DER++).
        activation_shape: per-sample activation shape, required by the ``kd`` tasks.
        device: where :meth:`wait` puts its tensors (``"cpu"`` or a CUDA device).
        global_sampling: draw from all ranks' buffers (one-sided reads) or only the local one.
        seed: base seed (each rank derives its own stream); ``None`` for OS entropy.
        comm: the ranks sharing the buffer (default ``MPI.COMM_WORLD``).  With
            ``global_sampling`` the constructor and :meth:`close` are collective over it.
        sample_dtypes: dtype of the samples (one, or one per sample tensor).
        activation_dtype: dtype of the activations.
        mode: ``"standard"`` (``wait`` returns new samples + representatives) or
            ``"flyweight"`` (representatives only, written into the ``out`` tensors given to
            :meth:`accumulate`).
        rehearsal_weight: loss weight of representatives (new samples weigh 1).
        progress_interval: seconds between MPI progress polls of the idle worker, for MPI
            transports that need the owner's progress to serve one-sided reads; ``None``
            polls every 2 ms only when ``comm`` spans several nodes, 0 never polls.
        timeout: seconds :meth:`wait` waits for the worker before raising ``TimeoutError``.
        max_pending: most ``accumulate`` calls allowed ahead of ``wait``.
        worker_niceness: nice value (0-19, Linux) of the worker thread alone, so that the
            training threads of all ranks on a node win the cores when they need them: the
            worker's work is off the critical path, a training thread late to the gradient
            all-reduce is on every rank's.  0 leaves the worker at the process's priority.
        start_delay: seconds the worker holds a new batch back before working on it, unless
            :meth:`wait` asks for it sooner: the first moments after a hand-over are when the
            training thread starts its step (and, with more ranks than cores, other ranks
            finish their all-reduce); the rehearsal has the rest of the step.
        transport: how representatives are read from other ranks: ``"mpi"`` (one-sided MPI RMA
            reads of a window) or ``"thallium"`` (Mochi Thallium RPC + bulk transfers served by
            each owner's Argobots progress; needs ``make native-mochi``, else
            :class:`~torchhpc.errors.EngineUnavailableError`).  Both never return a torn record.
            Without ``global_sampling`` nothing is read remotely and neither is set up.
        protocol: the Thallium (Mercury) protocol: ``"na+sm"`` (one node), ``"ofi+tcp"``,
            ``"ofi+verbs"`` or ``"ofi+cxi"`` (across nodes); ``None`` picks ``na+sm`` when all
            ranks share a node, else ``ofi+tcp``.  Only with ``transport="thallium"``.
    """

    def __init__(
        self,
        num_classes: int,
        slots_per_class: int,
        num_candidates: int,
        num_representatives: int,
        sample_shapes: Sequence[int] | Sequence[Sequence[int]],
        task: str = "rehearsal",
        activation_shape: Sequence[int] | None = None,
        device: str | torch.device = "cpu",
        global_sampling: bool = True,
        seed: int | None = None,
        comm: MPI.Comm | None = None,
        *,
        sample_dtypes: torch.dtype | Sequence[torch.dtype] = torch.float32,
        activation_dtype: torch.dtype = torch.float32,
        mode: str = "standard",
        rehearsal_weight: float = 1.0,
        progress_interval: float | None = None,
        timeout: float = 600.0,
        max_pending: int = 4,
        worker_niceness: int = 10,
        start_delay: float = 0.002,
        transport: str = "mpi",
        protocol: str | None = None,
    ) -> None:
        # Every rank checks its arguments and launch first, then the ranks agree: an error on one rank is
        # an error on all (RemoteError naming it), never a hang of the others in the collectives below.
        world = MPI.COMM_WORLD if comm is None else comm
        agree_s = float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else 600.0
        with agreed(world if global_sampling else MPI.COMM_SELF, agree_s, "RehearsalBuffer()"):
            if transport not in TRANSPORTS:
                raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
            if protocol is not None and transport != "thallium":
                raise ValueError(f"protocol={protocol!r} applies to transport='thallium' only")
            if protocol is not None and protocol not in PROTOCOLS:
                raise ValueError(f"protocol must be one of {PROTOCOLS} (or None), got {protocol!r}")
            if task not in TASKS:
                raise ValueError(f"task must be one of {TASKS}, got {task!r}")
            if mode not in ("standard", "flyweight"):
                raise ValueError(f"mode must be 'standard' or 'flyweight', got {mode!r}")
            for name, value, low in (
                ("num_classes", num_classes, 1),
                ("slots_per_class", slots_per_class, 1),
                ("num_candidates", num_candidates, 1),
                ("num_representatives", num_representatives, 0),
                ("max_pending", max_pending, 1),
                ("worker_niceness", worker_niceness, 0),
            ):
                if not isinstance(value, (int, np.integer)) or value < low:
                    raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
            self.task = task
            self.mode = mode
            self.K, self.N = int(num_classes), int(slots_per_class)
            self.C, self.R = int(num_candidates), int(num_representatives)
            self.stores_activations = task != "rehearsal"
            if self.stores_activations and activation_shape is None:
                raise ValueError(f"task {task!r} stores activations: give activation_shape")
            if not self.stores_activations and activation_shape is not None:
                raise ValueError("activation_shape given but task 'rehearsal' stores no activations")
            self.sample_shapes = _as_shapes(sample_shapes)
            self.multi = not (
                isinstance(sample_shapes, torch.Size)
                or all(isinstance(s, (int, np.integer)) for s in sample_shapes)
            )
            dtypes = [sample_dtypes] * len(self.sample_shapes) if isinstance(sample_dtypes, torch.dtype) \
                else list(sample_dtypes)
            if len(dtypes) != len(self.sample_shapes):
                raise ValueError(f"{len(dtypes)} sample_dtypes for {len(self.sample_shapes)} sample tensors")
            self.sample_dtypes = dtypes
            self.activation_shape = None if activation_shape is None else tuple(int(s) for s in activation_shape)
            self.activation_dtype = activation_dtype
            self.device = torch.device(device)
            if self.device.type == "cuda" and not torch.cuda.is_available():
                raise RuntimeError(f"device {device!r} requested but CUDA is not available here")
            if self.device.type not in ("cpu", "cuda"):
                raise ValueError(f"device must be cpu or cuda, got {device!r}")
            self.rehearsal_weight = float(rehearsal_weight)
            self.timeout = float(timeout)
            self.max_pending = int(max_pending)
            if worker_niceness > 19:
                raise ValueError(f"worker_niceness must be in [0, 19], got {worker_niceness}")
            self.worker_niceness = int(worker_niceness)
            if not isinstance(start_delay, (int, float)) or not (math.isfinite(start_delay) and start_delay >= 0):
                raise ValueError(f"start_delay must be a finite number of seconds >= 0, got {start_delay!r}")
            self.start_delay = float(start_delay)
            self.global_sampling = bool(global_sampling)

            self.rank, self.world_size = world.Get_rank(), world.Get_size()
            if comm is None and self.global_sampling:
                _check_launcher(self.rank, self.world_size)
            self.transport = transport
            # Thallium reads go through Argobots, not MPI: only the MPI transport needs THREAD_MULTIPLE.
            if self.global_sampling and transport == "mpi" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise RuntimeError(
                    "global_sampling needs MPI initialised with MPI_THREAD_MULTIPLE (the worker thread "
                    "reads peers' buffers while the training thread may call MPI); set "
                    "mpi4py.rc.thread_level = 'multiple' before importing mpi4py.MPI"
                )
            self.layout = RecordLayout(
                self.K, self.N, self.sample_shapes, self.sample_dtypes, self.activation_shape, activation_dtype
            )
        self._comm: MPI.Comm | None = None
        if self.global_sampling:
            self._comm = world.Dup()
        if self._comm is not None and transport == "thallium":
            if protocol is None:
                protocol = default_protocol(self._comm)
            if progress_interval is None:
                progress_interval = 0.0  # Argobots serves peers: no MPI progress to drive
        if progress_interval is None:
            progress_interval = 0.0
            if self._comm is not None:
                node = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
                multi_node = node.Get_size() < self._comm.Get_size()
                node.Free()
                progress_interval = 0.002 if multi_node else 0.0
        self.progress_interval = float(progress_interval)

        pin = self.device.type == "cuda"
        self.protocol = protocol
        if self._comm is not None and transport == "thallium":
            try:
                self.storage: SlotStorage = ThalliumSlotStorage(
                    self.layout, self._comm, pin, protocol, self.timeout
                )
            except BaseException:
                self._comm.Free()
                raise
        else:
            self.storage = SlotStorage(self.layout, self._comm, pin=pin)
        self.reservoir = ClassReservoir(self.K, self.N)
        entropy = [int(seed), self.rank] if seed is not None else None
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))
        self.stream_seen = np.zeros(self.K, dtype=np.int64)

        self._pool: list[tuple[dict[str, torch.Tensor], list[int]]] = []
        self._staging: dict[str, torch.Tensor] | None = None
        if self.device.type == "cuda":
            self._staging = self._alloc_rows(max(self.R, 1), torch.device("cpu"), pin=True)
            self._cuda_stream = torch.cuda.Stream(self.device)

        self._timings = {s: 0.0 for s in (*STAGES, "accumulate", "wait")}
        self._timing_counts = {s: 0 for s in self._timings}
        self._remote_bytes = 0
        self._iterations = 0
        self.last_num_representatives = 0
        self._pending = 0
        self._submitted = 0  # accumulate() calls so far
        self._wanted = 0  # batches with seq < _wanted have been asked for by wait(): no holding back
        self._hurry = threading.Condition()
        self._closed = False
        self._failed: BaseException | None = None
        self._requests: queue.Queue[_Request | None] = queue.Queue()
        self._results: queue.Queue[AugmentedBatch | BaseException] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name=f"rehearsal-worker-{self.rank}", daemon=True)
        self._worker.start()
        # Stop the worker before mpi4py finalises MPI at exit (atexit runs last-registered first).
        ref = weakref.ref(self)
        atexit.register(lambda: (b := ref()) is not None and b._stop_worker())

    # ------------------------------------------------------------------ public API
    def accumulate(
        self,
        samples: torch.Tensor | Sequence[torch.Tensor],
        targets: torch.Tensor,
        activations: torch.Tensor | None = None,
        *,
        out: AugmentedBatch | None = None,
    ) -> None:
        """Hand a new minibatch to the worker and return at once; :meth:`wait` gives the result.

        The tensors must not be modified until the matching :meth:`wait` returns.  Inputs are
        checked here, so a bad batch raises before anything reaches the buffer.

        ``out`` are caller-provided tensors for the result: in flyweight mode (required) with at
        least ``R`` rows for the representatives; in standard mode (optional) with at least
        ``b + R`` rows for the whole augmented batch.  A sample tensor that already is the first
        ``b`` rows of its ``out`` tensor (see :func:`spare_rows_collate`) is not copied at all.
        """
        t0 = time.perf_counter()
        self._check_usable()
        if self._pending >= self.max_pending:
            raise RuntimeError(f"{self._pending} accumulate() calls are pending: call wait() first")
        tensors = self._check_samples(samples)
        b = tensors[0].shape[0]
        labels = self._check_targets(targets, b)
        acts = self._check_activations(activations, b)
        if self.mode == "flyweight" or out is not None:
            self._check_out(out, self.R if self.mode == "flyweight" else b + self.R)
        self._pending += 1
        self._requests.put(_Request(tensors, labels, acts, out, self._submitted))
        self._submitted += 1
        self._add_time("accumulate", time.perf_counter() - t0)

    def wait(self, timeout: float | None = None) -> AugmentedBatch:
        """Block until the oldest pending :meth:`accumulate` is processed; return its augmented batch.

        Fewer than ``R`` representatives come back while the (global) buffer holds fewer
        samples; ``last_num_representatives`` says how many.
        """
        self._check_usable()
        if self._pending == 0:
            raise RuntimeError("wait() called without a pending accumulate()")
        limit = self.timeout if timeout is None else float(timeout)
        t0 = time.perf_counter()
        if self.start_delay:
            with self._hurry:  # the oldest pending batch is wanted now: its worker need not hold back
                self._wanted = max(self._wanted, self._submitted - self._pending + 1)
                self._hurry.notify()
        try:
            result = self._results.get(timeout=limit)
        except queue.Empty:
            raise PeerTimeoutError(
                f"rehearsal worker did not finish a batch in {limit:.0f}s (a peer rank stuck or dead?)"
            ) from None
        self._pending -= 1
        self._add_time("wait", time.perf_counter() - t0)
        if isinstance(result, BaseException):
            self._failed = result
            raise RuntimeError("the rehearsal worker failed; the buffer cannot be used further") from result
        return result

    def state_dict(self) -> dict[str, Any]:
        """This rank's buffer (filled records, counts, random state): enough to continue exactly.

        Each rank saves its own state; call with no ``accumulate`` pending.
        """
        self._check_usable()
        if self._pending:
            raise RuntimeError("state_dict() needs every accumulate() waited for first")
        lay = self.layout
        records = self.storage.bytes[lay.header_bytes :].view(lay.num_slots, lay.record_bytes)
        fill = self.reservoir.fill
        return {
            "format": _STATE_FORMAT,
            "layout": lay.describe(),
            "task": self.task,
            "rank": self.rank,
            "world_size": self.world_size,
            "records": [records[k * self.N : k * self.N + int(fill[k])].clone() for k in range(self.K)],
            # tensors and plain Python values only, so torch.load(weights_only=True) accepts it
            "reservoir": {k: torch.from_numpy(v) for k, v in self.reservoir.state_dict().items()},
            "stream_seen": torch.from_numpy(self.stream_seen.copy()),
            "rng": self.rng.bit_generator.state,
            "iterations": self._iterations,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` on the same rank of a same-sized job."""
        self._check_usable()
        if self._pending:
            raise RuntimeError("load_state_dict() needs every accumulate() waited for first")
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError("not a RehearsalBuffer state (or saved by an incompatible version)")
        if state["layout"] != self.layout.describe() or state["task"] != self.task:
            raise ValueError(
                f"saved buffer layout {state['layout']} / task {state['task']!r} does not match this "
                f"buffer's {self.layout.describe()} / {self.task!r}"
            )
        if state["world_size"] != self.world_size or state["rank"] != self.rank:
            raise ValueError(
                f"state saved by rank {state['rank']} of {state['world_size']}, loading into rank "
                f"{self.rank} of {self.world_size}: each rank must load its own shard"
            )
        lay = self.layout
        probe = ClassReservoir(self.K, self.N)
        probe.load_state_dict({k: np.asarray(v) for k, v in state["reservoir"].items()})  # validates first
        raw = torch.zeros(lay.total_bytes, dtype=torch.uint8)
        lay.fills(raw).copy_(torch.from_numpy(probe.fill))
        records = raw[lay.header_bytes :].view(lay.num_slots, lay.record_bytes)
        for k, rec in enumerate(state["records"]):
            if rec.shape != (int(probe.fill[k]), lay.record_bytes):
                raise ValueError(f"saved records of class {k} have shape {tuple(rec.shape)}")
            records[k * self.N : k * self.N + rec.shape[0]] = rec
        self.storage.load(raw)
        self.reservoir = probe
        self.stream_seen = np.asarray(state["stream_seen"], dtype=np.int64).copy()
        self.rng.bit_generator.state = state["rng"]
        self._iterations = int(state["iterations"])

    def stats(self) -> dict[str, Any]:
        """Buffer statistics and per-stage timings (mean milliseconds per iteration)."""
        timings = {
            s: 1e3 * self._timings[s] / self._timing_counts[s] if self._timing_counts[s] else 0.0
            for s in self._timings
        }
        return {
            "fill": self.reservoir.fill.tolist(),
            "size": int(self.reservoir.fill.sum()),
            "capacity": self.K * self.N,
            "samples_seen": self.stream_seen.tolist(),
            "candidates_seen": self.reservoir.seen.tolist(),
            "iterations": self._iterations,
            "last_num_representatives": self.last_num_representatives,
            "remote_bytes": self._remote_bytes,
            "timings_ms": timings,
            "timing_totals_s": dict(self._timings),
        }

    def reset_timings(self) -> None:
        """Zero the per-stage timings (e.g. after warm-up)."""
        for s in self._timings:
            self._timings[s] = 0.0
            self._timing_counts[s] = 0
        self._remote_bytes = 0

    def close(self) -> None:
        """Stop the worker and free the storage (collective over ``comm`` with global sampling)."""
        if self._closed:
            return
        self._stop_worker()
        self._closed = True
        self.storage.free()
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def __enter__(self) -> RehearsalBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ input checks
    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("the rehearsal buffer is closed")
        if self._failed is not None:
            raise RuntimeError("the rehearsal worker failed earlier") from self._failed

    def _check_samples(self, samples: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        tensors = [samples] if isinstance(samples, torch.Tensor) else list(samples)
        if len(tensors) != len(self.sample_shapes):
            raise ValueError(f"expected {len(self.sample_shapes)} sample tensor(s), got {len(tensors)}")
        b = None
        specs = zip(tensors, self.sample_shapes, self.sample_dtypes, strict=True)
        for i, (t, shape, dtype) in enumerate(specs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"sample tensor {i} is a {type(t).__name__}, not a torch.Tensor")
            if tuple(t.shape[1:]) != shape:
                raise ValueError(f"sample tensor {i} has per-sample shape {tuple(t.shape[1:])}, not {shape}")
            if t.dtype != dtype:
                raise TypeError(f"sample tensor {i} has dtype {t.dtype}, expected {dtype}")
            if t.device.type not in ("cpu", self.device.type):
                raise ValueError(f"sample tensor {i} is on {t.device}, expected cpu or {self.device}")
            if b is None:
                b = t.shape[0]
            elif t.shape[0] != b:
                raise ValueError(f"sample tensors disagree on batch size ({b} vs {t.shape[0]})")
        if b == 0:
            raise ValueError("empty minibatch")
        return tensors

    def _check_targets(self, targets: torch.Tensor, b: int) -> torch.Tensor:
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
        if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
            raise TypeError(f"targets must be an integer tensor of class labels, got {targets.dtype}")
        if tuple(targets.shape) != (b,):
            raise ValueError(f"targets have shape {tuple(targets.shape)}, expected ({b},)")
        labels = targets.to("cpu", torch.int64)
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= self.K:
            raise ValueError(f"labels must lie in [0, {self.K}), got values in [{lo}, {hi}]")
        return labels

    def _check_activations(self, activations: torch.Tensor | None, b: int) -> torch.Tensor | None:
        if not self.stores_activations:
            if activations is not None:
                raise ValueError("activations given but task 'rehearsal' stores none")
            return None
        if activations is None:
            raise ValueError(f"task {self.task!r} needs the activations of the new samples")
        if tuple(activations.shape) != (b, *self.activation_shape):
            raise ValueError(
                f"activations have shape {tuple(activations.shape)}, expected ({b}, {self.activation_shape})"
            )
        if activations.dtype != self.activation_dtype:
            raise TypeError(f"activations have dtype {activations.dtype}, expected {self.activation_dtype}")
        return activations.detach()

    def _check_out(self, out: AugmentedBatch | None, rows: int) -> None:
        if out is None:
            raise ValueError("flyweight mode: pass out=AugmentedBatch(...) tensors with >= R rows")
        if not isinstance(out, AugmentedBatch):
            raise TypeError(f"out must be an AugmentedBatch, got {type(out).__name__}")
        samples = [out.samples] if isinstance(out.samples, torch.Tensor) else list(out.samples)
        checks = list(zip(samples, self.sample_shapes, self.sample_dtypes, strict=False))
        if len(samples) != len(self.sample_shapes):
            raise ValueError(f"out has {len(samples)} sample tensors, expected {len(self.sample_shapes)}")
        checks += [(out.targets, (), torch.int64), (out.weights, (), torch.float32)]
        if self.stores_activations:
            if out.activations is None:
                raise ValueError("out.activations is required for this task")
            checks.append((out.activations, self.activation_shape, self.activation_dtype))
        for t, shape, dtype in checks:
            if tuple(t.shape[1:]) != tuple(shape) or t.dtype != dtype or t.shape[0] < rows:
                raise ValueError(
                    f"out tensor of shape {tuple(t.shape)} / {t.dtype} cannot hold {rows} rows of "
                    f"{tuple(shape)} / {dtype}"
                )
            if t.device != self.device or not t.is_contiguous():
                raise ValueError(f"out tensors must be contiguous and on {self.device}")

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        if self.worker_niceness and sys.platform.startswith("linux"):
            # On Linux a thread is a task with its own nice value: this lowers the worker only.
            tid = threading.get_native_id()
            with contextlib.suppress(OSError):  # raising one's nice value needs no privilege; if refused, run as is
                os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), self.worker_niceness))
        poll = self.progress_interval > 0 and self._comm is not None and self.transport == "mpi"
        while True:
            try:
                req = self._requests.get(timeout=self.progress_interval if poll else None)
            except queue.Empty:
                self._comm.Iprobe()  # type: ignore[union-attr]  # drive MPI progress for peers' reads
                continue
            if req is None:
                return
            if self.start_delay:
                # Leave the first moments of the step to the training thread, unless it already waits for this batch.
                with self._hurry:
                    self._hurry.wait_for(lambda s=req.seq: self._wanted > s, timeout=self.start_delay)
            try:
                result: AugmentedBatch | BaseException = self._process(req)
            except BaseException as exc:  # handed to wait(), which re-raises it in the caller
                result = exc
            self._results.put(result)
            del req, result  # hold no reference to a handed-out batch: its memory can be recycled

    def _stop_worker(self) -> None:
        if self._worker.is_alive():
            self._requests.put(None)
            self._worker.join(timeout=self.timeout)

    def _add_time(self, stage: str, seconds: float) -> None:
        self._timings[stage] += seconds
        self._timing_counts[stage] += 1

    def _output_block(self, rows: int, capacity: int) -> dict[str, torch.Tensor]:
        """Tensors for an augmented batch of ``rows`` rows, recycled once the caller has let go of them.

        Fresh multi-megabyte allocations cost far more than the copy into them (the kernel
        maps and zeroes new pages, and unmaps them when freed), so finished batches are
        reused, but only when no tensor anywhere still refers to their memory.
        """
        if self.device.type == "cuda":  # the caching allocator already recycles device memory
            return self._alloc_rows(max(rows, capacity), self.device)
        for block, counts in self._pool:
            if block["label"].shape[0] >= rows and all(
                _storage_refs(t) == c for t, c in zip(block.values(), counts, strict=True)
            ):
                return block
        block = self._alloc_rows(max(rows, capacity), self.device)
        if _storage_refs is not _no_refs and len(self._pool) < _POOL_SIZE:
            self._pool.append((block, [_storage_refs(t) for t in block.values()]))
        return block

    def _copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` in pieces of about ``_COPY_CHUNK`` bytes, offering the core to other threads between them.

        A multi-megabyte copy holds a core for milliseconds; on a node with more processes than
        cores, a training thread waiting on the core (e.g. to finish its gradient all-reduce,
        which every rank then waits for) would otherwise lose that long.
        """
        row_bytes = max(1, src[0].numel() * src.element_size()) if src.shape[0] else 1
        step = max(1, _COPY_CHUNK // row_bytes)
        if src.shape[0] <= step:
            dst.copy_(src)
            return
        for lo in range(0, src.shape[0], step):
            dst[lo : lo + step].copy_(src[lo : lo + step])
            _yield_core()

    def _alloc_rows(self, rows: int, device: torch.device, pin: bool = False) -> dict[str, torch.Tensor]:
        out = {"label": torch.empty(rows, dtype=torch.int64, device=device, pin_memory=pin)}
        for i, (shape, dtype) in enumerate(zip(self.sample_shapes, self.sample_dtypes, strict=True)):
            out[f"sample{i}"] = torch.empty((rows, *shape), dtype=dtype, device=device, pin_memory=pin)
        if self.stores_activations:
            out["activation"] = torch.empty(
                (rows, *self.activation_shape), dtype=self.activation_dtype, device=device, pin_memory=pin
            )
        return out

    def _process(self, req: _Request) -> AugmentedBatch:
        b = req.targets.shape[0]
        t0 = time.perf_counter()
        # Destination rows, ready before the read epoch opens: the caller's tensors, or recycled
        # or new ones; representatives go after the new samples (standard) or from row 0 (flyweight).
        first = b if self.mode == "standard" else 0
        if req.out is None:
            dest = self._output_block(b + self.R, b + self.R)
        else:
            out = req.out
            dest = {"label": out.targets}
            samples = [out.samples] if isinstance(out.samples, torch.Tensor) else list(out.samples)
            dest.update({f"sample{i}": s for i, s in enumerate(samples)})
            if self.stores_activations:
                dest["activation"] = out.activations
        # Representatives land in host rows first when the output lives on a GPU.
        host = self._staging if self._staging is not None else {k: v[first : first + self.R] for k, v in dest.items()}
        # uint8 (rows, bytes) numpy views of those rows, for the one-sided Gets to land in directly
        host_bytes = {
            k: v.reshape(v.shape[0], math.prod(v.shape[1:])).view(torch.uint8).numpy() for k, v in host.items()
        }
        setup = time.perf_counter() - t0

        t0 = time.perf_counter()
        ranks, flat_slots, windowed = self._draw()
        m = len(flat_slots)
        t1 = time.perf_counter()
        self._add_time("sampling", t1 - t0)

        is_local = ranks == self.rank
        try:
            if windowed and not is_local.all():
                rows_bytes = {k: v[:m] for k, v in host_bytes.items()}
                self._remote_bytes += self.storage.remote_read(ranks, flat_slots, rows_bytes)
                self.storage.flush()
        finally:
            if windowed:
                self.storage.end_remote()
        t2 = time.perf_counter()
        self._add_time("remote_fetch", t2 - t1)
        rep_rows = {k: v[:m] for k, v in host.items()}

        local = np.nonzero(is_local)[0]
        if len(local):
            lo, hi = int(local[0]), int(local[-1]) + 1
            self.storage.read_local(
                torch.from_numpy(flat_slots[lo:hi]), {k: v[lo:hi] for k, v in rep_rows.items()}
            )
        if self._staging is not None:
            # Order after work already queued on the default stream (e.g. kernels still reading
            # memory the caching allocator just handed to this batch).
            self._cuda_stream.wait_stream(torch.cuda.default_stream(self.device))
            with torch.cuda.stream(self._cuda_stream):
                for k, v in rep_rows.items():
                    dest[k][first : first + m].copy_(v, non_blocking=True)
        if self.mode == "standard":
            news = [("label", req.targets)] + [(f"sample{i}", s) for i, s in enumerate(req.samples)]
            if self.stores_activations:
                news.append(("activation", req.activations))
            for key, src in news:
                if not _is_prefix(src, dest[key]):  # already in place: nothing to copy
                    self._copy_rows(dest[key][:b], src)
        weights = torch.empty(first + m, dtype=torch.float32)
        weights[:first] = 1.0
        weights[first:] = 0.0 if self.task == "kd" else self.rehearsal_weight
        if req.out is not None:
            req.out.weights[: first + m].copy_(weights)
            weights = req.out.weights[: first + m]
        else:
            weights = weights.to(self.device)
        if self._staging is not None:
            self._cuda_stream.synchronize()
        t3 = time.perf_counter()
        self._add_time("copy", setup + t3 - t2)

        self._update(req)
        self._add_time("update", time.perf_counter() - t3)
        self._iterations += 1
        self.last_num_representatives = m

        n_out = first + m
        samples_out = [dest[f"sample{i}"][:n_out] for i in range(len(self.sample_shapes))]
        return AugmentedBatch(
            samples=samples_out if self.multi else samples_out[0],
            targets=dest["label"][:n_out],
            weights=weights,
            activations=dest["activation"][:n_out] if self.stores_activations else None,
        )

    def _draw(self) -> tuple[np.ndarray, np.ndarray, bool]:
        """Pick representatives; with global sampling this opens the shared read epoch on all ranks."""
        own = self.reservoir.fill[None, :]
        if self.R == 0:
            ranks, flat = draw_representatives(own, self.N, 0, self.rng)
            return ranks, flat, False
        if not self.global_sampling or not self.storage.remote:
            ranks, flat = draw_representatives(own, self.N, self.R, self.rng)
            return ranks + self.rank, flat, False
        self.storage.begin_remote()
        try:
            others = [r for r in range(self.world_size) if r != self.rank]
            fills = np.empty((self.world_size, self.K), dtype=np.int64)
            if others:
                fills[others] = self.storage.remote_fills(others)
            fills[self.rank] = self.reservoir.fill
            ranks, flat = draw_representatives(fills, self.N, self.R, self.rng)
        except BaseException:
            self.storage.end_remote()
            raise
        return ranks, flat, True

    def _update(self, req: _Request) -> None:
        """Offer C random candidates of the new batch to the per-class reservoirs; write the kept ones."""
        labels = req.targets.numpy()
        b = labels.shape[0]
        self.stream_seen += np.bincount(labels, minlength=self.K)
        c = min(self.C, b)
        rows = np.sort(self.rng.choice(b, size=c, replace=False))
        writes = self.reservoir.offer(labels[rows], self.rng)
        flat = writes.labels * self.N + writes.slots
        self.storage.write(
            flat, writes.labels, rows[writes.rows], req.samples, req.activations, self.reservoir.fill
        )
