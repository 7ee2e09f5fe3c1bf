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

from ..runtime import native
from ..runtime.errors import EngineUnavailableError, PeerTimeoutError
from ..runtime.waiting import agreed, allgather_object, barrier, wait_requests
from .layout import RecordLayout
from .options import TASKS, TRANSPORTS, RehearsalOptions
from .reservoir import ClassReservoir
from .sampler import draw_representatives
from .storage import SlotStorage
from .thallium import ThalliumSlotStorage, default_protocol, spans_nodes

__all__ = ["AugmentedBatch", "RehearsalBuffer", "TASKS", "STAGES", "TRANSPORTS"]

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


def _agreement(options: RehearsalOptions | None, given: dict[str, Any], world: MPI.Comm) -> tuple[MPI.Comm, float]:
    """The ranks that agree on the constructor's errors, and for how long they wait for each other."""
    def pick(name: str, default: Any) -> Any:
        return given[name] if given[name] is not None else getattr(options, name, default)

    timeout = pick("timeout", 600.0)
    agree_s = float(timeout) if isinstance(timeout, int | float) and timeout > 0 else 600.0
    return (world if pick("global_sampling", True) else MPI.COMM_SELF), agree_s


def _check_launcher(rank: int, size: int) -> None:
    """Refuse a job whose launcher started more processes than MPI connects (e.g. torchrun, no mpiexec).

    Each process would then be an MPI world of its own and "global" sampling would silently
    stay local.
    """
    from torchhpc.runtime.world import world_info

    info = world_info()
    if (info.world_size, info.rank) != (size, rank):
        raise RuntimeError(
            f"the launcher ({info.launcher}) says rank {info.rank} of {info.world_size} but MPI.COMM_WORLD "
            f"is rank {rank} of {size}: global sampling needs the ranks connected by MPI (start the job "
            "with mpiexec/srun), or pass global_sampling=False or an explicit comm"
        )


class RehearsalBuffer:
    """A rehearsal buffer distributed over the ranks of ``comm``, maintained in the background.

    Its settings are the fields of :class:`~torchhpc.rehearsal.RehearsalOptions`, each documented there:
    given as keywords (the first five are ``K``, ``N``, ``C``, ``R`` and the sample shape), or as
    ``options=RehearsalOptions(...)``, or both (keywords that are not ``None`` override the options' fields).
    ``comm`` holds the ranks sharing the buffer (default ``MPI.COMM_WORLD``); with ``global_sampling`` the
    constructor and :meth:`close` are collective over it, and neither waits for its peers longer than
    ``timeout`` seconds.  ``options`` keeps the settings in use.
    """

    def __init__(
        self,
        num_classes: int | None = None,
        slots_per_class: int | None = None,
        num_candidates: int | None = None,
        num_representatives: int | None = None,
        sample_shapes: Sequence[int] | Sequence[Sequence[int]] | None = None,
        task: str | None = None,
        activation_shape: Sequence[int] | None = None,
        device: str | torch.device | None = None,
        global_sampling: bool | None = None,
        seed: int | None = None,
        comm: MPI.Comm | None = None,
        *,
        sample_dtypes: torch.dtype | Sequence[torch.dtype] | None = None,
        activation_dtype: torch.dtype | None = None,
        mode: str | None = None,
        rehearsal_weight: float | None = None,
        progress_interval: float | None = None,
        timeout: float | None = None,
        max_pending: int | None = None,
        worker_niceness: int | None = None,
        start_delay: float | None = None,
        transport: str | None = None,
        protocol: str | None = None,
        options: RehearsalOptions | None = None,
    ) -> None:
        given = {"num_classes": num_classes, "slots_per_class": slots_per_class, "num_candidates": num_candidates,
                 "num_representatives": num_representatives, "sample_shapes": sample_shapes, "task": task,
                 "activation_shape": activation_shape, "device": device, "global_sampling": global_sampling,
                 "seed": seed, "sample_dtypes": sample_dtypes, "activation_dtype": activation_dtype, "mode": mode,
                 "rehearsal_weight": rehearsal_weight, "progress_interval": progress_interval, "timeout": timeout,
                 "max_pending": max_pending, "worker_niceness": worker_niceness, "start_delay": start_delay,
                 "transport": transport, "protocol": protocol}
        world = MPI.COMM_WORLD if comm is None else comm
        # Every rank checks its settings and launch first, then the ranks agree: an error on one rank is an
        # error on all (RemoteError naming it), never a hang of the others in the collectives that follow.
        peers, agree_s = _agreement(options, given, world)
        with agreed(peers, agree_s, "RehearsalBuffer()"):
            self._configure(RehearsalOptions.resolve(options, **given), world, launched=comm is None)
        # collective, once: whether remote reads cross nodes (the default transport, MPI's progress polling)
        self._spans_nodes = self.global_sampling and self.world_size > 1 and spans_nodes(world)
        self.transport = self._choose_transport(world, self.options.transport)
        with agreed(peers, agree_s, "RehearsalBuffer()"):
            self._check_thread_level()
        self._open_transport(world)
        self._init_state()

    # ------------------------------------------------------------------ construction steps
    def _configure(self, opts: RehearsalOptions, world: MPI.Comm, launched: bool) -> None:
        """Validate the settings and this rank's environment; derive what the later steps need (local)."""
        opts.validate()
        self.options = opts
        self.task, self.mode = opts.task, opts.mode
        self.K, self.N = int(opts.num_classes), int(opts.slots_per_class)
        self.C, self.R = int(opts.num_candidates), int(opts.num_representatives)
        self.stores_activations = opts.stores_activations
        self.sample_shapes, self.multi, self.sample_dtypes = opts.shapes, opts.multi, opts.dtypes
        self.activation_shape = None if opts.activation_shape is None else tuple(int(s) for s in opts.activation_shape)
        self.activation_dtype = opts.activation_dtype
        self.device = torch.device(opts.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {opts.device!r} requested but CUDA is not available here")
        self.rehearsal_weight = float(opts.rehearsal_weight)
        self.timeout = float(opts.timeout)
        self.max_pending = int(opts.max_pending)
        self.worker_niceness = int(opts.worker_niceness)
        self.start_delay = float(opts.start_delay)
        self.global_sampling = bool(opts.global_sampling)
        self.protocol = opts.protocol
        self.rank, self.world_size = world.Get_rank(), world.Get_size()
        if launched and self.global_sampling:
            _check_launcher(self.rank, self.world_size)
        self.layout = RecordLayout(
            self.K, self.N, self.sample_shapes, self.sample_dtypes, self.activation_shape, self.activation_dtype
        )

    def _check_thread_level(self) -> None:
        """Thallium reads go through Argobots, not MPI: only the MPI transport needs THREAD_MULTIPLE (local)."""
        if self.global_sampling and self.transport == "mpi" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "global_sampling needs MPI initialised with MPI_THREAD_MULTIPLE (the worker thread "
                "reads peers' buffers while the training thread may call MPI); set "
                "mpi4py.rc.thread_level = 'multiple' before importing mpi4py.MPI"
            )

    def _choose_transport(self, world: MPI.Comm, transport: str) -> str:
        """``transport``, or for ``"auto"``: Thallium across nodes where every rank has it built, else MPI
        (collective, with global sampling)."""
        if transport != "auto":
            return transport
        if not self._spans_nodes:
            return "mpi"
        try:
            native.load("thallium")
            built = True
        except EngineUnavailableError:
            built = False
        everywhere = all(allgather_object(world, built, self.timeout, "rehearsal buffer: choosing the transport"))
        return "thallium" if everywhere else "mpi"

    def _open_transport(self, world: MPI.Comm) -> None:
        """Collective (with global sampling): this buffer's communicator, the progress policy and the storage."""
        self._comm: MPI.Comm | None = world.Dup() if self.global_sampling else None
        thallium = self._comm is not None and self.transport == "thallium"
        if thallium and self.protocol is None:
            self.protocol = default_protocol(self._comm)
        self.progress_interval = self._progress_interval(thallium)
        pin = self.device.type == "cuda"
        if not thallium:
            self.storage: SlotStorage = SlotStorage(self.layout, self._comm, pin=pin)
            return
        try:
            self.storage = ThalliumSlotStorage(self.layout, self._comm, pin, self.protocol, self.timeout)
        except BaseException:
            self._comm.Free()
            raise

    def _progress_interval(self, thallium: bool) -> float:
        """The worker's MPI progress period: as given, else 2 ms when an MPI transport spans nodes, else 0."""
        if self.options.progress_interval is not None:
            return float(self.options.progress_interval)
        if thallium or self._comm is None:
            return 0.0  # Argobots serves Thallium's peers: no MPI progress to drive
        return 0.002 if self._spans_nodes else 0.0

    def _init_state(self) -> None:
        """The reservoir, random stream, output pools and timers; then start the worker (local)."""
        self.reservoir = ClassReservoir(self.K, self.N)
        seed = self.options.seed
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
        self._close_pending: list[Any] | None = None  # a close() whose barrier passed its deadline
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
        """Stop the worker and free the storage (collective over ``comm`` with global sampling).

        Every rank must call it: without them it raises :class:`~torchhpc.runtime.errors.PeerTimeoutError` after
        ``timeout`` s, the buffer refusing further use; a later ``close()``, once the peers have called it,
        frees the storage."""
        if self._closed:
            return
        self._stop_worker()
        if self._comm is not None:
            self._wait_for_peers_to_close()
        self._closed = True
        self.storage.free()
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def _wait_for_peers_to_close(self) -> None:
        """The deadline barrier before freeing what peers may still read; kept pending if it times out."""
        what = "RehearsalBuffer.close()"
        try:
            if self._close_pending is None:
                barrier(self._comm, self.timeout, what)
            else:  # an earlier close() gave up: the same barrier, completed by the late peers
                wait_requests(self._close_pending, self.timeout, f"{what} is collective: every rank must close "
                              "its buffer; a retry")
        except PeerTimeoutError as exc:
            self._close_pending = exc.requests
            raise
        self._close_pending = None

    def __enter__(self) -> RehearsalBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ input checks
    def _check_usable(self) -> None:
        if self._closed or self._close_pending is not None:
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
        """One batch: draw representatives, read them (remote, then local), copy the new rows, update."""
        b = req.targets.shape[0]
        t0 = time.perf_counter()
        # Destination rows, ready before the read epoch opens: the caller's tensors, or recycled
        # or new ones; representatives go after the new samples (standard) or from row 0 (flyweight).
        first = b if self.mode == "standard" else 0
        dest = self._destination(req, b)
        # Representatives land in host rows first when the output lives on a GPU.
        host = self._staging if self._staging is not None else {k: v[first : first + self.R] for k, v in dest.items()}
        setup = time.perf_counter() - t0

        m, local_s = self._read_representatives(host)
        t2 = time.perf_counter()
        self._place_representatives(dest, {k: v[:m] for k, v in host.items()}, first)
        if self.mode == "standard":
            self._place_new(req, dest, b)
        weights = self._weights(req, first, m)
        if self._staging is not None:
            self._cuda_stream.synchronize()
        t3 = time.perf_counter()
        self._add_time("copy", setup + local_s + t3 - t2)

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

    def _destination(self, req: _Request, b: int) -> dict[str, torch.Tensor]:
        """The output tensors of a batch of ``b`` new rows, by field: the caller's ``out``, or pooled ones."""
        if req.out is None:
            return self._output_block(b + self.R, b + self.R)
        out = req.out
        dest = {"label": out.targets}
        samples = [out.samples] if isinstance(out.samples, torch.Tensor) else list(out.samples)
        dest.update({f"sample{i}": s for i, s in enumerate(samples)})
        if self.stores_activations:
            dest["activation"] = out.activations
        return dest

    def _read_representatives(self, host: dict[str, torch.Tensor]) -> tuple[int, float]:
        """Draw the representatives and read them into the first rows of ``host``.

        Returns how many, and the seconds the local reads took (timed as copying, remote reads as fetching)."""
        # uint8 (rows, bytes) numpy views of those rows, for the one-sided Gets to land in directly
        host_bytes = {
            k: v.reshape(v.shape[0], math.prod(v.shape[1:])).view(torch.uint8).numpy() for k, v in host.items()
        }
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
        local = np.nonzero(is_local)[0]
        if len(local):
            lo, hi = int(local[0]), int(local[-1]) + 1
            self.storage.read_local(
                torch.from_numpy(flat_slots[lo:hi]), {k: v[lo:hi] for k, v in host.items()}
            )
        return m, time.perf_counter() - t2

    def _place_representatives(self, dest: dict[str, torch.Tensor], rep_rows: dict[str, torch.Tensor],
                               first: int) -> None:
        """Copy staged representatives (GPU outputs only) into the output rows from ``first`` on."""
        if self._staging is None:
            return  # already read in place
        # Order after work already queued on the default stream (e.g. kernels still reading
        # memory the caching allocator just handed to this batch).
        self._cuda_stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self._cuda_stream):
            for k, v in rep_rows.items():
                dest[k][first : first + v.shape[0]].copy_(v, non_blocking=True)

    def _place_new(self, req: _Request, dest: dict[str, torch.Tensor], b: int) -> None:
        """Copy the batch's own rows in front of the representatives (standard mode)."""
        news = [("label", req.targets)] + [(f"sample{i}", s) for i, s in enumerate(req.samples)]
        if self.stores_activations:
            news.append(("activation", req.activations))
        for key, src in news:
            if not _is_prefix(src, dest[key]):  # already in place: nothing to copy
                self._copy_rows(dest[key][:b], src)

    def _weights(self, req: _Request, first: int, m: int) -> torch.Tensor:
        """Per-row loss weights: 1 for the new rows, the rehearsal weight (0 for ``kd``) for representatives."""
        weights = torch.empty(first + m, dtype=torch.float32)
        weights[:first] = 1.0
        weights[first:] = 0.0 if self.task == "kd" else self.rehearsal_weight
        if req.out is not None:
            req.out.weights[: first + m].copy_(weights)
            return req.out.weights[: first + m]
        return weights.to(self.device)

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
