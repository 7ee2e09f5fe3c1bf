"""``ProcessGroupACCL``: the torch.distributed process group behind the ``"accl"`` backend.

A thin adapter from torch's process-group API to plans: each method checks its arguments on the
calling rank (tensor counts, dtypes, sizes, roots, tags, op/dtype pairs; a bad one raises
``ValueError``/``TypeError`` naming the problem), builds the collective's plan (:mod:`.plans`,
:mod:`.p2p`) and hands it to the group's :class:`~.executor.Executor`, which runs it inline (a
synchronous call of contiguous CPU tensors on an idle group) or queued.  On the MPI engine the
collectives are the compiled core's calls (:mod:`.calls`).  Wire behaviour, ordering, timeouts and
failures live there, once.  Where the C++ front is built (``_front.cpp``, :func:`.core.load_front`), a
group's ``allreduce``, ``broadcast``, ``all_gather_single``, ``reduce_scatter_single`` and
``all_to_all_single`` are the front's: it reads torch's arguments in C++, runs the common synchronous case
through the core, and hands every other call to the method of this class.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI

from . import calls, core, plans, wire
from .engine import CollectiveEngine
from .executor import FALLBACK, Executor
from .header import Reduction
from .monitored import monitored_barrier
from .options import AcclOptions
from .p2p import Recv, Send
from .reduction import RedOp, op_name, red_op_of
from .work import AcclWork

__all__ = ["ProcessGroupACCL"]

_R = RedOp
_SUM = RedOp.SUM


def _one(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """The single tensor of a one-tensor-per-call argument list."""
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
        raise ValueError(f"accl: {what} takes exactly one tensor per call, got {len(tensors)}")
    t = tensors[0]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"accl: {what} expects a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise TypeError(f"accl: {what} does not support sparse tensors")
    return t


def _async(opts: object) -> bool:
    return bool(getattr(opts, "asyncOp", True)) if opts is not None else True


def _op(opts: object) -> RedOp:
    if opts is None:
        return _R.SUM
    op = getattr(opts.reduceOp, "op", None)  # type: ignore[attr-defined]
    return op if type(op) is RedOp else red_op_of(opts.reduceOp)  # type: ignore[attr-defined]


class ProcessGroupACCL(dist.ProcessGroup):
    """A process group whose collectives run on an MPI communicator (or an ACCL engine)."""

    def __init__(self, comm: MPI.Comm, rank: int, size: int, timeout: timedelta,
                 options: AcclOptions | None = None, group_name: str = ""):
        super().__init__(rank, size)
        if comm.Get_rank() != rank or comm.Get_size() != size:
            raise RuntimeError(f"accl: MPI communicator is rank {comm.Get_rank()} of {comm.Get_size()} "
                               f"but torch expects rank {rank} of {size}")
        self.options = options if options is not None else AcclOptions()
        self._rank = rank
        self._size = size
        self._timeout_s = timeout.total_seconds() if timeout is not None else 1800.0
        self._name = group_name
        self._desc = "undefined"
        self._ex = Executor(comm, self.options, self._timeout_s, group_name)
        self._reductions: dict[tuple[torch.dtype, int], Reduction] = {}
        self._sums: dict[torch.dtype, Reduction] = {}  # the SUM entries of _reductions, by dtype
        self._tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767)
        self._front = None
        if self._ex.engine is self._ex.mpi and self.options.front:
            front = core.load_front()
            if front is not None:
                self._install_front(front)

    def _install_front(self, mod: object) -> None:
        """Route torch's hottest calls through the C++ front (:mod:`.core`): it reads torch's arguments in
        C++ and runs the common case (synchronous, contiguous CPU tensors, a dtype and reduction this group
        has seen) through the core; every other case it hands to this class's method of the same name."""
        ex = self._ex
        kinds = tuple(wire.kind_code(k) for k in ("all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                                   "all_to_all"))
        f = mod.Front(self, ex, ex.mpi, ex.core, kinds, torch.Tensor)  # type: ignore[attr-defined]
        for dtype in wire.DTYPES:
            f.learn_dtype(dtype, wire.dtype_code(dtype))
        self._front = f
        # torch calls these by name on the group (from Python, and from C++ through pybind11's override
        # lookup): the instance's attributes come first
        self.allreduce = f.entry("all_reduce")
        self.broadcast = f.entry("broadcast")
        self.all_gather_single = self._allgather_base = f.entry("all_gather_single")
        self.reduce_scatter_single = self._reduce_scatter_base = f.entry("reduce_scatter_single")
        self.all_to_all_single = self.alltoall_base = f.entry("all_to_all_single")

    # ----------------------------------------------------------------- identity
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "accl"

    def setGroupName(self, name: str) -> None:  # noqa: N802 (torch's name; a Python PG keeps its own)
        self._name = name
        self._ex.name = name
        self._ex.hx.group = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def __repr__(self) -> str:
        return f"ProcessGroupACCL(rank={self._rank}, size={self._size}, engine={self._ex.engine.name})"

    @property
    def engine(self) -> CollectiveEngine:
        """The engine carrying out this group's collectives (``mpi`` or ``accl``)."""
        return self._ex.engine

    @property
    def stats(self) -> dict[str, int]:
        """Engine calls made, calls sidestepped to MPI, and the largest bytes of one call's buffer."""
        return self._ex.stats

    @property
    def header(self):  # noqa: ANN201 - HeaderExchange
        """The group's header exchange (its ``persistent`` request, for tests and diagnostics)."""
        return self._ex.hx

    # ----------------------------------------------------------------- plumbing
    def _engine_for(self, coll: str, dtype: torch.dtype | None = None, op: RedOp | None = None
                    ) -> CollectiveEngine:
        ex = self._ex
        eng = ex.engine
        if eng is ex.mpi:
            return eng
        if eng.supports(coll, dtype, op):
            return eng
        if coll in self.options.sidestep:
            return ex.mpi
        what = coll + (f" of {dtype}" if dtype is not None else "") + (f" with {op_name(op)}" if op else "")
        raise NotImplementedError(
            f"accl: the {eng.name} engine cannot do {what} and sidestep to MPI is disabled for "
            f"'{coll}' (AcclOptions.sidestep / TORCHHPC_ACCL_SIDESTEP)")

    def _reduction(self, dtype: torch.dtype, op: RedOp, what: str) -> Reduction:
        key = (dtype, op.value)  # keyed by the op's int value: hashing torch's enum costs more
        red = self._reductions.get(key)
        if red is None:
            red = self._reductions[key] = Reduction(dtype, op, what)
            if op == _SUM:
                self._sums[dtype] = red
            if self._front is not None:  # the front takes the pair from now on (not AVG: it divides after)
                self._front.learn_reduction(dtype, op.value, None if red.avg else red.core)
        return red

    def _red_of(self, opts: object, dtype: torch.dtype, what: str) -> Reduction:
        """The reduction ``opts`` asks for on ``dtype``.  SUM, the common case, is looked up by dtype alone
        (comparing torch's ``ReduceOp`` costs far less than unwrapping or hashing it)."""
        if opts is None or opts.reduceOp == _SUM:  # type: ignore[attr-defined]
            red = self._sums.get(dtype)
            if red is not None:
                return red
        return self._reduction(dtype, _op(opts), what)

    def _run(self, plan: object, opts: object) -> AcclWork | None:
        """Run ``plan`` inline when it is a synchronous core call on the MPI engine (a core call is made
        directly only from contiguous CPU tensors) and the group is idle, else queue it."""
        ex = self._ex
        if (opts is not None and not getattr(opts, "asyncOp", True) and type(plan) is ex.core_call
                and ex.engine is ex.mpi):
            done = ex.run_core(plan)
            if done is not FALLBACK:
                return done  # type: ignore[return-value]
        return self._submit(plan, _async(opts))

    def _submit(self, plan: object, async_op: bool = True) -> AcclWork:
        """Queue ``plan`` (the path of async calls, and of synchronous calls on a busy group)."""
        return self._ex.submit(plan, async_op)

    # ----------------------------------------------------------------- all_reduce
    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> AcclWork | None:
        t = tensors[0] if type(tensors) is list and len(tensors) == 1 else None
        if type(t) is not torch.Tensor or t.is_sparse:  # (the exact-type test is the cheap one)
            t = _one(tensors, "all_reduce")
        red = self._red_of(opts, t.dtype, "all_reduce")
        return self._run(self._allreduce_plan([t], red, "all_reduce"), opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> AcclWork:
        if not tensors:
            raise ValueError("accl: all_reduce_coalesced needs at least one tensor")
        red = self._red_of(opts, tensors[0].dtype, "all_reduce_coalesced")
        return self._submit(self._allreduce_plan(list(tensors), red, "all_reduce_coalesced"), _async(opts))

    def _allreduce_plan(self, ts: list[torch.Tensor], red: Reduction, kind: str) -> object:
        ex = self._ex
        if ex.aborted is not None:
            ex.check_open()
        if len(ts) > 1:
            dtype = ts[0].dtype
            for t in ts[1:]:
                if t.dtype != dtype:
                    raise TypeError(f"accl: {kind} needs tensors of one dtype, got {dtype} and {t.dtype}")
                if t.device != ts[0].device:
                    raise ValueError(f"accl: {kind} needs tensors on one device")
        if ex.engine is ex.mpi or self._engine_for("allreduce", red.dtype, red.op) is ex.mpi:
            return calls.all_reduce(ex, ts, red, kind)
        return plans.AllReduce(ex, ex.engine, ts, red, kind)

    # ----------------------------------------------------------------- broadcast / reduce
    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> AcclWork | None:
        t = tensors[0] if type(tensors) is list and len(tensors) == 1 else None
        if type(t) is not torch.Tensor or t.is_sparse:
            t = _one(tensors, "broadcast")
        if opts is None:
            root = 0
        else:
            root = opts.rootRank
            if opts.rootTensor != 0:
                raise ValueError(f"accl: broadcast rootTensor must be 0, got {opts.rootTensor}")
        if type(root) is not int or not 0 <= root < self._size:
            self._check_root(root, "broadcast")
        ex = self._ex
        if ex.aborted is not None:
            ex.check_open()
        if ex.engine is ex.mpi or self._engine_for("broadcast", t.dtype) is ex.mpi:
            plan = calls.broadcast(ex, t, root)
        else:
            plan = plans.Broadcast(ex, ex.engine, t, root)
        return self._run(plan, opts)

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> AcclWork:
        t = _one(tensors, "reduce")
        root = opts.rootRank if opts is not None else 0
        self._check_root(root, "reduce")
        red = self._red_of(opts, t.dtype, "reduce")
        op = red.op
        self._ex.check_open()
        eng = self._engine_for("reduce", t.dtype, op)
        return self._submit(plans.Reduce(self._ex, eng, t, red, root, self.options.check), _async(opts))

    # ----------------------------------------------------------------- gathers
    def _gather_plan(self, kind: str, inp: torch.Tensor, rows: torch.Tensor | Callable[[], torch.Tensor | None],
                     deliver: Callable[[torch.Tensor], None] | None, root: int, outputs: list) -> object:
        ex = self._ex
        if ex.aborted is not None:
            ex.check_open()
        eng = ex.engine if ex.engine is ex.mpi else self._engine_for("allgather" if kind == "all_gather" else "gather",
                                                                     inp.dtype)
        if kind == "all_gather" and eng is ex.mpi:
            return calls.all_gather(ex, inp, rows, deliver, outputs)  # type: ignore[arg-type]
        header = self.options.check or (kind == "all_gather" and ex.header_needed(eng, inp.nbytes * self._size))
        return plans.GatherLike(ex, eng, kind, inp, rows, deliver, root, outputs, header)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts=None) -> AcclWork:
        inp = _one(input_tensors, "all_gather")
        if len(output_tensors) != 1:
            raise ValueError(f"accl: all_gather takes one output list, got {len(output_tensors)}")
        outs = output_tensors[0]
        self._check_list(outs, inp, "all_gather", "output_tensor_list")
        p, numel = self._size, inp.numel()
        mpi = self._ex.mpi

        def rows() -> torch.Tensor:
            return torch.empty((p, numel), dtype=inp.dtype, device="cpu" if inp.device.type == "cpu"
                               or not mpi.accepts(inp.device) else inp.device)

        def deliver(dst: torch.Tensor) -> None:
            for r, o in enumerate(outs):
                o.copy_(dst[r].view(o.shape))

        return self._submit(self._gather_plan("all_gather", inp, rows, deliver, 0, [outs]), _async(opts))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts=None) -> AcclWork:
        """``output_lists[r][j]`` receives rank r's ``input_list[j]`` (torch's layout: one list per rank)."""
        if not input_list:
            raise ValueError("accl: all_gather_coalesced needs at least one input tensor")
        if len(output_lists) != self._size or any(len(o) != len(input_list) for o in output_lists):
            raise ValueError(f"accl: all_gather_coalesced needs {self._size} output lists (one per rank), each "
                             f"with one tensor per input tensor ({len(input_list)})")
        works = [self.allgather([[out[j] for out in output_lists]], [inp], opts)
                 for j, inp in enumerate(input_list)]
        return works[-1]  # collectives complete in issue order: the last one covers all

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> AcclWork | None:  # noqa: A002
        p = self._size
        if type(output) is not torch.Tensor or type(input) is not torch.Tensor:
            for name, t in (("output", output), ("input", input)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"accl: all_gather_into_tensor {name} must be a tensor")
        if output.dtype != input.dtype:
            raise TypeError(f"accl: all_gather_into_tensor dtypes differ: output {output.dtype}, "
                            f"input {input.dtype}")
        numel = input.numel()
        if output.numel() != p * numel:
            raise ValueError(f"accl: all_gather_into_tensor output has {output.numel()} elements, needs "
                             f"world_size * input = {p} * {numel} = {p * numel}")
        if output.is_contiguous() and (output.is_cpu or self._ex.mpi.accepts(output.device)):
            plan = self._gather_plan("all_gather", input, output, None, 0, [output])  # gathered in place
        else:
            def rows() -> torch.Tensor:
                return torch.empty((p, numel), dtype=input.dtype)

            def deliver(dst: torch.Tensor) -> None:
                output.copy_(dst.view(output.shape))

            plan = self._gather_plan("all_gather", input, rows, deliver, 0, [output])
        return self._run(plan, opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts=None) -> AcclWork | None:
        return self._coalesced(self.all_gather_single, "all_gather_into_tensor", outputs, inputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts=None) -> AcclWork:
        inp = _one(input_tensors, "gather")
        root = opts.rootRank if opts is not None else 0
        self._check_root(root, "gather")
        p, numel = self._size, inp.numel()
        outs = self._root_list(output_tensors, inp, root, "gather", "gather_list")
        is_root = self._rank == root

        def rows() -> torch.Tensor | None:
            return torch.empty((p, numel), dtype=inp.dtype) if is_root else None

        def deliver(dst: torch.Tensor) -> None:
            for r, o in enumerate(outs):
                o.copy_(dst[r].view(o.shape))

        plan = self._gather_plan("gather", inp, rows, deliver, root, [outs] if outs else [])
        return self._submit(plan, _async(opts))

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts=None) -> AcclWork:
        out = _one(output_tensors, "scatter")
        root = opts.rootRank if opts is not None else 0
        self._check_root(root, "scatter")
        ins = self._root_list(input_tensors, out, root, "scatter", "scatter_list")
        self._ex.check_open()
        eng = self._engine_for("scatter", out.dtype)
        return self._submit(plans.Scatter(self._ex, eng, out, list(ins), root, self.options.check), _async(opts))

    # ----------------------------------------------------------------- reduce_scatter
    def _reduce_scatter_plan(self, out: torch.Tensor, rows: torch.Tensor | Callable[[], torch.Tensor], opts: object,
                             ) -> object:
        red = self._red_of(opts, out.dtype, "reduce_scatter")
        ex = self._ex
        if ex.aborted is not None:
            ex.check_open()
        if ex.engine is ex.mpi or self._engine_for("reduce_scatter", out.dtype, red.op) is ex.mpi:
            return calls.reduce_scatter(ex, out, rows, red)
        return plans.ReduceScatter(ex, ex.engine, out, rows, red)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts=None) -> AcclWork:
        out = _one(output_tensors, "reduce_scatter")
        if len(input_tensors) != 1:
            raise ValueError("accl: reduce_scatter takes one input list")
        ins = input_tensors[0]
        self._check_list(ins, out, "reduce_scatter", "input_list")
        plan = self._reduce_scatter_plan(out, lambda: torch.stack([i.reshape(-1).cpu() for i in ins]), opts)
        return self._submit(plan, _async(opts))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> AcclWork | None:  # noqa: A002
        p = self._size
        if output.dtype != input.dtype:
            raise TypeError(f"accl: reduce_scatter_tensor dtypes differ: output {output.dtype}, "
                            f"input {input.dtype}")
        if input.numel() != p * output.numel():
            raise ValueError(f"accl: reduce_scatter_tensor input has {input.numel()} elements, needs "
                             f"world_size * output = {p} * {output.numel()} = {p * output.numel()}")
        if input.is_cpu and input.is_contiguous():
            rows: torch.Tensor | Callable[[], torch.Tensor] = input
        else:
            def rows() -> torch.Tensor:
                return input.reshape(-1).contiguous().cpu()

        return self._run(self._reduce_scatter_plan(output, rows, opts), opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts=None) -> AcclWork | None:
        return self._coalesced(self.reduce_scatter_single, "reduce_scatter_tensor", outputs, inputs, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    @staticmethod
    def _coalesced(one: Callable, name: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                   opts: object) -> AcclWork | None:
        """A ``*_coalesced`` call as one call of ``one`` per (output, input) pair, in order: collectives
        complete in issue order, so the last one's Work covers them all."""
        if len(outputs) != len(inputs) or not inputs:
            raise ValueError(f"accl: {name}_coalesced needs matching, non-empty lists")
        works = [one(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return works[-1]

    # ----------------------------------------------------------------- all_to_all
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: list[int], input_split_sizes: list[int], opts=None
                          ) -> AcclWork | None:
        p = self._size
        if output.dtype != input.dtype:
            raise TypeError(f"accl: all_to_all_single dtypes differ: output {output.dtype}, "
                            f"input {input.dtype}")
        esz = input.element_size()
        shape_in, shape_out = input.shape, output.shape
        if (not input_split_sizes and not output_split_sizes and shape_in and shape_out
                and shape_in[0] % p == 0 and shape_out[0] % p == 0
                and (len(shape_in) == len(shape_out) == 1 or shape_in[1:] == shape_out[1:])):
            # even splits (the common case): equal blocks
            sb, rb = [input.numel() * esz // p] * p, [output.numel() * esz // p] * p
        else:
            # elements per dim-0 row (shape arithmetic: indexing a tensor costs more than the whole call)
            row_in = math.prod(input.shape[1:]) if input.dim() > 0 and input.shape[0] else 0
            row_out = math.prod(output.shape[1:]) if output.dim() > 0 and output.shape[0] else 0
            row = max(row_in, row_out, 1) if input.dim() > 1 or output.dim() > 1 else 1
            s_in = self._splits(list(input_split_sizes), input, "input")
            s_out = self._splits(list(output_split_sizes), output, "output")
            sb = [s * row * esz for s in s_in]
            rb = [s * row * esz for s in s_out]
        ex = self._ex
        if ex.aborted is not None:
            ex.check_open()
        if ex.engine is not ex.mpi:
            self._engine_for("alltoallv", input.dtype)  # the MPI engine's: a sidestep, if allowed
        plan = calls.all_to_all(ex, input, output, sb, rb, [output])
        return self._run(plan, opts)

    alltoall_base = all_to_all_single

    def _splits(self, sizes: list[int], t: torch.Tensor, name: str) -> list[int]:
        p = self._size
        if not sizes:
            if t.dim() == 0 or t.shape[0] % p:
                raise ValueError(f"accl: all_to_all_single {name} dim 0 ({tuple(t.shape)}) is not "
                                 f"divisible by world_size {p}; pass split sizes")
            return [t.shape[0] // p] * p
        if len(sizes) != p:
            raise ValueError(f"accl: all_to_all_single {name}_split_sizes has {len(sizes)} entries, "
                             f"world_size is {p}")
        if any(s < 0 for s in sizes):
            raise ValueError(f"accl: all_to_all_single {name}_split_sizes must be >= 0, got {sizes}")
        if sum(sizes) != (t.shape[0] if t.dim() else 1):
            raise ValueError(f"accl: all_to_all_single {name}_split_sizes sum to {sum(sizes)} but "
                             f"{name} has {t.shape[0] if t.dim() else 1} rows")
        return list(sizes)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts=None) -> AcclWork:
        p = self._size
        if len(output_tensors) != p or len(input_tensors) != p:
            raise ValueError(f"accl: all_to_all needs {p} input and {p} output tensors, got "
                             f"{len(input_tensors)} and {len(output_tensors)}")
        dtype = input_tensors[0].dtype
        if any(t.dtype != dtype for t in list(input_tensors) + list(output_tensors)):
            raise TypeError("accl: all_to_all needs every tensor of one dtype")
        esz = input_tensors[0].element_size()
        send = torch.cat([t.reshape(-1).cpu() for t in input_tensors]) if p else torch.empty(0, dtype=dtype)
        recv = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype)
        sb = [t.numel() * esz for t in input_tensors]
        rb = [t.numel() * esz for t in output_tensors]

        def deliver() -> None:
            off = 0
            for t in output_tensors:
                t.copy_(recv[off: off + t.numel()].view(t.shape))
                off += t.numel()

        self._ex.check_open()
        if self._ex.engine is not self._ex.mpi:
            self._engine_for("alltoallv", dtype)  # the MPI engine's: a sidestep, if allowed
        plan = calls.all_to_all(self._ex, send, recv, sb, rb, list(output_tensors), deliver)
        return self._submit(plan, _async(opts))

    # ----------------------------------------------------------------- barrier
    def barrier(self, opts=None) -> AcclWork | None:
        self._ex.check_open()
        if self._ex.engine is not self._ex.mpi:
            self._engine_for("barrier")  # the MPI engine's: a sidestep, if allowed
        plan = calls.barrier(self._ex, self.options.check)
        return self._run(plan, opts)

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """Barrier that names the ranks that did not arrive within ``timeout``, as gloo's does: rank 0
        raises for the first missing rank, or for every one with ``wait_all_ranks=True``.

        ``dist.monitored_barrier`` itself accepts only gloo groups; call this method on the group.
        """
        secs = timeout.total_seconds() if timeout is not None else self._timeout_s
        monitored_barrier(self._ex.mpi.p2p[0], secs, wait_all_ranks)

    # ----------------------------------------------------------------- point-to-point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> AcclWork:
        t = _one(tensors, "send")
        self._check_peer(dst, "send", "dst")
        self._check_tag(tag)
        self._ex.check_open()
        return self._ex.submit(Send(self._ex, self._engine_for("send", t.dtype), t, dst, tag), p2p=True)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> AcclWork:
        t = _one(tensors, "recv")
        self._check_peer(src, "recv", "src")
        return self._recv(t, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> AcclWork:
        return self._recv(_one(tensors, "recv"), -1, tag)

    def _recv(self, t: torch.Tensor, src: int, tag: int) -> AcclWork:
        self._check_tag(tag)
        self._ex.check_open()
        plan = Recv(self._ex, self._engine_for("recv", t.dtype), t, src, tag, self._engine_for)
        return self._ex.submit(plan, p2p=True)

    # ----------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        """Stop the progress thread and free communicators (pending work is failed)."""
        self._ex.shutdown()

    def abort(self) -> None:
        self._ex.shutdown()

    # ----------------------------------------------------------------- argument checks
    def _check_root(self, root: int, what: str) -> None:
        if not isinstance(root, int) or not 0 <= root < self._size:
            raise ValueError(f"accl: {what} root {root} is not a rank of this group (size {self._size})")

    def _check_peer(self, peer: int, what: str, name: str) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self._size:
            raise ValueError(f"accl: {what} {name}={peer} is not a rank of this group (size {self._size})")

    def _check_tag(self, tag: int) -> None:
        ub = self._tag_ub
        if not isinstance(tag, int) or not 0 <= tag <= ub:
            raise ValueError(f"accl: tag {tag} out of range [0, {ub}] (MPI_TAG_UB)")

    def _root_list(self, lists: list[list[torch.Tensor]], ref: torch.Tensor, root: int, what: str, name: str
                   ) -> list[torch.Tensor]:
        """The root's one tensor list of gather/scatter (checked against ``ref``); [] on the other ranks,
        which must pass none."""
        if self._rank == root:
            if len(lists) != 1:
                raise ValueError(f"accl: {what} on the root takes one {name}")
            self._check_list(lists[0], ref, what, name)
            return lists[0]
        if lists and any(len(x) for x in lists):
            raise ValueError(f"accl: {name} must be empty/None on non-root ranks")
        return []

    def _check_list(self, lst: Sequence[torch.Tensor], ref: torch.Tensor, what: str, name: str) -> None:
        if len(lst) != self._size:
            raise ValueError(f"accl: {what} {name} has {len(lst)} tensors, world_size is {self._size}")
        for i, x in enumerate(lst):
            if x.dtype != ref.dtype:
                raise TypeError(f"accl: {what} {name}[{i}] is {x.dtype}, expected {ref.dtype}")
            if x.numel() != ref.numel():
                raise ValueError(f"accl: {what} {name}[{i}] has {x.numel()} elements, expected {ref.numel()} "
                                 f"(all ranks' tensors must have the same size)")
