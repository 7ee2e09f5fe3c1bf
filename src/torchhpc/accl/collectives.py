"""Collective operations of :class:`~.process_group.ProcessGroupACCL` (a mixin: the group class
provides queueing, checks, staging and engines; see its module docstring)."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta

import torch
from mpi4py import MPI

from ..waiting import Backoff, wait_until
from .common import (
    _DTYPE_CODE,
    _F_SEQ,
    _HDR_WORDS,
    _KIND,
    _MAGIC,
    _R,
    _SMALL_BYTES,
    AcclMismatchError,
    _as_bytes,
    _async,
    _describe,
    _mpi_op,
    _ranges,
    _Tensorish,
)
from .engine import Request
from .fastpath import FALLBACK, HEADER, MATRIX_MAX_RANKS
from .mpi_engine import MpiRequest
from .reduction import RedOp, check_reduction, op_name, red_op_of
from .work import AcclTimeoutError, AcclWork, Op, now


class CollectivesMixin:
    """all_reduce ... barrier, as torch's c10d calls them on a Python process group."""

    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> AcclWork | None:
        t = _Tensorish.one(tensors, "all_reduce")
        op_t = red_op_of(opts.reduceOp) if opts is not None else _R.SUM
        if self._sync_fast(opts, t):
            done = self._allreduce_now(t, op_t)
            if done is not FALLBACK:
                return done
        return self._allreduce([t], op_t, "all_reduce", _async(opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> AcclWork:
        op_t = red_op_of(opts.reduceOp) if opts is not None else _R.SUM
        if not tensors:
            raise ValueError("accl: all_reduce_coalesced needs at least one tensor")
        return self._allreduce(list(tensors), op_t, "all_reduce_coalesced", _async(opts))

    def _allreduce(self, ts: list[torch.Tensor], op_t: RedOp, kind: str, async_op: bool) -> AcclWork:
        dtype = ts[0].dtype
        for t in ts[1:]:
            if t.dtype != dtype:
                raise TypeError(f"accl: {kind} needs tensors of one dtype, got {dtype} and {t.dtype}")
            if t.device != ts[0].device:
                raise ValueError(f"accl: {kind} needs tensors on one device")
        check_reduction(dtype, op_t, kind)
        eng = self._engine_for("allreduce", dtype, op_t)
        # payloads up to a header slot ride in the MPI header exchange (MPI engine only: with ACCL
        # the data always goes to the device, or is sidestepped by the rules of AcclOptions.sidestep)
        fuse = eng is self._mpi and self.options.check
        op = self._new_op(kind, ts)
        numel = sum(t.numel() for t in ts)
        esz = ts[0].element_size()
        nbytes = numel * esz
        op.big = nbytes >= self._big
        op.describe = lambda: f"{kind}({dtype}, {numel} elements, {op_name(op_t)}) #{op.seq}"
        p = self._size
        state: dict[str, torch.Tensor] = {}

        def gather_flat() -> torch.Tensor:
            if len(ts) == 1:
                return self._stage_in(ts[0], eng)
            return torch.cat([t.reshape(-1) for t in ts]).to("cpu" if not eng.accepts(ts[0].device)
                                                               else ts[0].device)

        def scatter_back(flat: torch.Tensor) -> None:
            if len(ts) == 1:
                self._stage_out(flat, ts[0])
                return
            off = 0
            for t in ts:
                t.copy_(flat[off: off + t.numel()].view(t.shape))
                off += t.numel()

        if fuse and nbytes <= _SMALL_BYTES:
            # the payload rides in the header exchange; every rank reduces the p slots itself, exactly
            # as the synchronous fast path does (so ranks taking either path agree bit for bit)
            red = self._reduction(dtype, op_t)

            def start_check() -> Request:
                flat = gather_flat()
                if flat.device.type != "cpu":
                    flat = flat.cpu()
                state["flat"] = flat
                HEADER.pack_into(self._hdr_buf, 0, _MAGIC, _KIND[kind], op.seq, red.dcode, red.ocode, 0,
                                 nbytes, numel, 0)
                if nbytes:
                    self._hdr_bytes[:nbytes] = _as_bytes(flat)
                return MpiRequest([self._hdr_start()])

            def verify() -> None:
                self._verify_rows(self._hdr_all)
                flat = state["flat"]
                if nbytes:
                    self._reduce_slots(red, nbytes)
                    _as_bytes(flat).copy_(self._hdr_all_bytes[0, :nbytes])
                if red.avg:
                    flat.div_(p)
                scatter_back(flat)

            op.check = (start_check, verify)
            return self._submit(op, async_op)

        # a header (always when checked; unchecked, for what does not fit one nonblocking call) makes
        # the data phase blocking MPI calls: the same rule and calls as the synchronous fast path
        if self._header_needed(eng, nbytes):
            self._add_check_lazy(op, kind, dtype, numel, nbytes, op_t)

        def stage0() -> list[Request]:
            flat = gather_flat()
            state["flat"] = flat
            per = self._per(esz)
            return [self._call(eng, "allreduce", (b - a) * esz, flat[a:b], _mpi_op(op_t))
                    for a, b in _ranges(numel, per) if b > a]

        def finish() -> None:
            flat = state["flat"]
            if op_t == _R.AVG:
                flat.div_(p)
            scatter_back(flat)

        op.stages = [stage0]
        op.finish = finish
        return self._submit(op, async_op)

    def _sync_fast(self, opts: object, a: torch.Tensor, b: torch.Tensor | None = None) -> bool:
        """Whether a call may try its synchronous fast path: not async, on the MPI engine, contiguous
        CPU tensors (the fast path itself then falls back when the group is busy)."""
        return (not _async(opts) and self._engine is self._mpi and a.is_cpu and a.is_contiguous()
                and (b is None or (b.is_cpu and b.is_contiguous())))

    def _header_needed(self, eng: object, total_bytes: int) -> bool:
        """Whether a collective moving ``total_bytes`` exchanges the header: always when checked; on an
        unchecked MPI group when it does not fit one nonblocking call (the header then proves that every
        rank arrived before the blocking calls).  The fast paths follow the same rule."""
        return self.options.check or (eng is self._mpi and total_bytes > self._unchecked_one_call)

    def _fused_start(self, header: list[int], flat: torch.Tensor, allh_holder: dict) -> Request:
        mine = self._hdr_np
        mine[:] = 0
        mine[: len(header)] = header
        nbytes = flat.numel() * flat.element_size()
        if nbytes:
            self._hdr_bytes[:nbytes] = _as_bytes(flat if flat.device.type == "cpu" else flat.cpu())
        allh_holder["allh"] = self._hdr_all
        return MpiRequest([self._hdr_start()])

    def _verify_rows(self, allh: torch.Tensor, fused: bool = False, vary_bytes: bool = False,
                     words: int = 8) -> None:
        """Raise AcclMismatchError naming what each rank called unless every rank's leading header
        ``words`` agree (magic, kind, seq, dtype, op, root, bytes, numel)."""
        h = (self._hdr_all_np if allh is self._hdr_all else allh.numpy())[:, :_HDR_WORDS]
        sub = h[:, :3] if vary_bytes else h[:, :words]
        raw = sub.tobytes()  # every row equal <=> the rows' bytes are p copies of row 0's (cheap on the hot path)
        if raw != raw[: len(raw) // self._size] * self._size:
            groups: dict[str, list[int]] = {}
            for r, row in enumerate(h.tolist()):
                groups.setdefault(_describe(row), []).append(r)
            detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {d}"
                               for d, rs in groups.items())
            raise AcclMismatchError(f"accl: ranks disagree on a collective in group '{self._name}' "
                                    f"({detail})")

    def _add_check_lazy(self, op: Op, kind: str, dtype: torch.dtype | None, numel: int, nbytes: int,
                        op_t: RedOp | None = None, root: int = 0, vary_bytes: bool = False,
                        on_verified: Callable[[torch.Tensor], None] | None = None) -> None:
        """Header exchange started when ``op`` reaches the head of the queue (its seq is known then)."""
        holder: dict[str, torch.Tensor] = {}

        def start() -> Request:
            header = self._header(kind, dtype, numel, nbytes, op_t, root)
            header[_F_SEQ] = op.seq
            return self._fused_start(header, torch.empty(0, dtype=torch.uint8), holder)

        def verify() -> None:
            self._verify_rows(holder["allh"], vary_bytes=vary_bytes)
            if on_verified is not None:
                on_verified(holder["allh"])

        op.check = (start, verify)

    # ----------------------------------------------------------------- broadcast / reduce
    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> AcclWork:
        t = _Tensorish.one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        self._check_root(root, "broadcast")
        if opts is not None and opts.rootTensor != 0:
            raise ValueError(f"accl: broadcast rootTensor must be 0, got {opts.rootTensor}")
        eng = self._engine_for("broadcast", t.dtype)
        if self._sync_fast(opts, t):
            done = self._broadcast_now(t, root)
            if done is not FALLBACK:
                return done
        op = self._new_op("broadcast", [t])
        esz, numel = t.element_size(), t.numel()
        op.big = numel * esz >= self._big
        op.describe = lambda: f"broadcast({t.dtype}, {numel} elements, root {root}) #{op.seq}"
        if self._header_needed(eng, numel * esz):
            self._add_check_lazy(op, "broadcast", t.dtype, numel, numel * esz, None, root)
        state: dict[str, torch.Tensor] = {}

        def stage0() -> list[Request]:
            flat = self._stage_in(t, eng, copy=(self._rank == root))
            state["flat"] = flat
            per = self._per(esz)
            return [self._call(eng, "broadcast", (b - a) * esz, flat[a:b], root)
                    for a, b in _ranges(numel, per) if b > a]

        def finish() -> None:
            if self._rank != root:
                self._stage_out(state["flat"], t)

        op.stages, op.finish = [stage0], finish
        return self._submit(op, _async(opts))

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> AcclWork:
        t = _Tensorish.one(tensors, "reduce")
        root = opts.rootRank if opts is not None else 0
        op_t = red_op_of(opts.reduceOp) if opts is not None else _R.SUM
        self._check_root(root, "reduce")
        check_reduction(t.dtype, op_t, "reduce")
        eng = self._engine_for("reduce", t.dtype, op_t)
        op = self._new_op("reduce", [t])
        esz, numel = t.element_size(), t.numel()
        op.big = numel * esz >= self._big
        op.describe = lambda: f"reduce({t.dtype}, {numel} elements, {op_name(op_t)}, root {root}) #{op.seq}"
        if self.options.check:
            self._add_check_lazy(op, "reduce", t.dtype, numel, numel * esz, op_t, root)
        state: dict[str, torch.Tensor] = {}

        def stage0() -> list[Request]:
            flat = self._stage_in(t, eng)
            if flat.data_ptr() == t.data_ptr() and self._rank != root:
                flat = flat.clone()  # MPI may use non-root send buffers as scratch? keep input intact
            state["flat"] = flat
            per = self._per(esz)
            return [self._call(eng, "reduce", (b - a) * esz, flat[a:b], _mpi_op(op_t), root)
                    for a, b in _ranges(numel, per) if b > a]

        def finish() -> None:
            if self._rank == root:
                flat = state["flat"]
                if op_t == _R.AVG:
                    flat.div_(self._size)
                self._stage_out(flat, t)

        op.stages, op.finish = [stage0], finish
        return self._submit(op, _async(opts))

    # ----------------------------------------------------------------- gathers
    def _gather_like(self, kind: str, inp: torch.Tensor, out_rows: Callable[[], torch.Tensor | None],
                     deliver: Callable[[torch.Tensor], None] | None, root: int, outputs: list,
                     async_op: bool) -> AcclWork:
        """all_gather / gather: ``out_rows()`` gives the [p, n] destination (None off-root for gather)."""
        coll = "allgather" if kind == "all_gather" else "gather"
        eng = self._engine_for(coll, inp.dtype)
        op = self._new_op(kind, outputs)
        esz, numel, p = inp.element_size(), inp.numel(), self._size
        op.big = numel * esz * p >= self._big
        op.describe = lambda: f"{kind}({inp.dtype}, {numel} elements per rank) #{op.seq}"
        if self.options.check or (kind == "all_gather" and self._header_needed(eng, numel * esz * p)):
            self._add_check_lazy(op, kind, inp.dtype, numel, numel * esz, None, root)
        state: dict = {}

        def stage0() -> list[Request]:
            src = self._stage_in(inp, eng)
            dst = out_rows()
            state["dst"] = dst
            per = self._per(esz, p)
            reqs = []
            for a, b in _ranges(numel, per):
                if b == a and numel:
                    continue
                seg_dst = dst[:, a:b] if dst is not None else None
                if kind == "all_gather":
                    reqs.append(self._call(eng, "allgather", (b - a) * esz * p, src[a:b], seg_dst))
                else:
                    reqs.append(self._call(eng, "gather", (b - a) * esz * p, src[a:b], seg_dst, root))
            return reqs

        def finish() -> None:
            if deliver is not None and state["dst"] is not None:
                deliver(state["dst"])

        op.stages, op.finish = [stage0], finish
        return self._submit(op, async_op)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts=None) -> AcclWork:
        inp = _Tensorish.one(input_tensors, "all_gather")
        if len(output_tensors) != 1:
            raise ValueError(f"accl: all_gather takes one output list, got {len(output_tensors)}")
        outs = output_tensors[0]
        self._check_list(outs, inp, "all_gather", "output_tensor_list")
        p, numel = self._size, inp.numel()

        def rows() -> torch.Tensor:
            return torch.empty((p, numel), dtype=inp.dtype, device="cpu" if inp.device.type == "cpu"
                               or not self._mpi.accepts(inp.device) else inp.device)

        def deliver(dst: torch.Tensor) -> None:
            for r, o in enumerate(outs):
                o.copy_(dst[r].view(o.shape))

        return self._gather_like("all_gather", inp, rows, deliver, 0, [outs], _async(opts))

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

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> AcclWork:  # noqa: A002
        p = self._size
        for name, t in (("output", output), ("input", input)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"accl: all_gather_into_tensor {name} must be a tensor")
        if output.dtype != input.dtype:
            raise TypeError(f"accl: all_gather_into_tensor dtypes differ: output {output.dtype}, "
                            f"input {input.dtype}")
        if output.numel() != p * input.numel():
            raise ValueError(f"accl: all_gather_into_tensor output has {output.numel()} elements, needs "
                             f"world_size * input = {p} * {input.numel()} = {p * input.numel()}")
        if self._sync_fast(opts, input, output):
            done = self._all_gather_now(output, input)
            if done is not FALLBACK:
                return done
        numel = input.numel()
        direct = output.is_contiguous() and (output.device.type == "cpu" or self._mpi.accepts(output.device))

        def rows() -> torch.Tensor:
            if direct:
                return output.view(p, numel)
            return torch.empty((p, numel), dtype=input.dtype)

        def deliver(dst: torch.Tensor) -> None:
            if not direct:
                output.copy_(dst.view(output.shape))

        return self._gather_like("all_gather", input, rows, deliver, 0, [output], _async(opts))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts=None) -> AcclWork:
        return self._coalesced(self.all_gather_single, "all_gather_into_tensor", outputs, inputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts=None) -> AcclWork:
        inp = _Tensorish.one(input_tensors, "gather")
        root = opts.rootRank if opts is not None else 0
        self._check_root(root, "gather")
        p, numel = self._size, inp.numel()
        if self._rank == root:
            if len(output_tensors) != 1:
                raise ValueError("accl: gather on the root takes one gather_list")
            outs = output_tensors[0]
            self._check_list(outs, inp, "gather", "gather_list")
        else:
            if output_tensors and any(len(x) for x in output_tensors):
                raise ValueError("accl: gather_list must be empty/None on non-root ranks")
            outs = []

        def rows() -> torch.Tensor | None:
            return torch.empty((p, numel), dtype=inp.dtype) if self._rank == root else None

        def deliver(dst: torch.Tensor) -> None:
            for r, o in enumerate(outs):
                o.copy_(dst[r].view(o.shape))

        return self._gather_like("gather", inp, rows, deliver, root, [outs] if outs else [],
                                 _async(opts))

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts=None) -> AcclWork:
        out = _Tensorish.one(output_tensors, "scatter")
        root = opts.rootRank if opts is not None else 0
        self._check_root(root, "scatter")
        p, numel, esz = self._size, out.numel(), out.element_size()
        if self._rank == root:
            if len(input_tensors) != 1:
                raise ValueError("accl: scatter on the root takes one scatter_list")
            ins = input_tensors[0]
            self._check_list(ins, out, "scatter", "scatter_list")
        else:
            if input_tensors and any(len(x) for x in input_tensors):
                raise ValueError("accl: scatter_list must be empty/None on non-root ranks")
            ins = []
        eng = self._engine_for("scatter", out.dtype)
        op = self._new_op("scatter", [out])
        op.big = numel * esz * p >= self._big
        op.describe = lambda: f"scatter({out.dtype}, {numel} elements per rank, root {root}) #{op.seq}"
        if self.options.check:
            self._add_check_lazy(op, "scatter", out.dtype, numel, numel * esz, None, root)
        state: dict = {}

        def stage0() -> list[Request]:
            src = torch.stack([i.reshape(-1) for i in ins]).cpu() if ins else None
            dst = self._stage_in(out, eng, copy=False)
            state["src"], state["dst"] = src, dst
            per = self._per(esz, p)
            return [self._call(eng, "scatter", (b - a) * esz * p,
                               src[:, a:b] if src is not None else None, dst[a:b], root)
                    for a, b in _ranges(numel, per) if b > a]

        def finish() -> None:
            self._stage_out(state["dst"], out)

        op.stages, op.finish = [stage0], finish
        return self._submit(op, _async(opts))

    # ----------------------------------------------------------------- reduce_scatter
    def _reduce_scatter(self, out: torch.Tensor, src_rows: Callable[[], torch.Tensor], op_t: RedOp,
                        outputs: list, async_op: bool) -> AcclWork:
        check_reduction(out.dtype, op_t, "reduce_scatter")
        eng = self._engine_for("reduce_scatter", out.dtype, op_t)
        op = self._new_op("reduce_scatter", outputs)
        p, numel, esz = self._size, out.numel(), out.element_size()
        op.big = numel * esz * p >= self._big
        op.describe = lambda: (f"reduce_scatter({out.dtype}, {numel} elements per rank, {op_name(op_t)}) "
                               f"#{op.seq}")
        if self._header_needed(eng, numel * esz * p):
            self._add_check_lazy(op, "reduce_scatter", out.dtype, numel, numel * esz, op_t)
        state: dict = {}

        def stage0() -> list[Request]:
            src = src_rows()
            dst = self._stage_in(out, eng, copy=False)
            state["dst"] = dst
            per = self._per(esz, p)
            reqs = []
            for a, b in _ranges(numel, per):
                if b == a:
                    continue
                block = src[:, a:b].contiguous() if (b - a) != numel else src
                reqs.append(self._call(eng, "reduce_scatter", (b - a) * esz * p, block, dst[a:b],
                                       _mpi_op(op_t)))
            return reqs

        def finish() -> None:
            dst = state["dst"]
            if op_t == _R.AVG:
                dst.div_(p)
            self._stage_out(dst, out)

        op.stages, op.finish = [stage0], finish
        return self._submit(op, async_op)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts=None) -> AcclWork:
        out = _Tensorish.one(output_tensors, "reduce_scatter")
        if len(input_tensors) != 1:
            raise ValueError("accl: reduce_scatter takes one input list")
        ins = input_tensors[0]
        self._check_list(ins, out, "reduce_scatter", "input_list")
        op_t = red_op_of(opts.reduceOp) if opts is not None else _R.SUM
        return self._reduce_scatter(out, lambda: torch.stack([i.reshape(-1).cpu() for i in ins]),
                                    op_t, [out], _async(opts))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> AcclWork:  # noqa: A002
        p = self._size
        if output.dtype != input.dtype:
            raise TypeError(f"accl: reduce_scatter_tensor dtypes differ: output {output.dtype}, "
                            f"input {input.dtype}")
        if input.numel() != p * output.numel():
            raise ValueError(f"accl: reduce_scatter_tensor input has {input.numel()} elements, needs "
                             f"world_size * output = {p} * {output.numel()} = {p * output.numel()}")
        op_t = red_op_of(opts.reduceOp) if opts is not None else _R.SUM
        if self._sync_fast(opts, input, output):
            done = self._reduce_scatter_now(output, input, op_t)
            if done is not FALLBACK:
                return done

        def rows() -> torch.Tensor:
            return input.reshape(p, output.numel()).contiguous().cpu()

        return self._reduce_scatter(output, rows, op_t, [output], _async(opts))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts=None) -> AcclWork:
        return self._coalesced(self.reduce_scatter_single, "reduce_scatter_tensor", outputs, inputs, opts)

    @staticmethod
    def _coalesced(one: Callable, name: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                   opts: object) -> AcclWork | None:
        """A ``*_coalesced`` call as one call of ``one`` per (output, input) pair, in order: collectives
        complete in issue order, so the last one's Work covers them all."""
        if len(outputs) != len(inputs) or not inputs:
            raise ValueError(f"accl: {name}_coalesced needs matching, non-empty lists")
        works = [one(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return works[-1]

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ----------------------------------------------------------------- all_to_all
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: list[int], input_split_sizes: list[int], opts=None) -> AcclWork:
        p = self._size
        if output.dtype != input.dtype:
            raise TypeError(f"accl: all_to_all_single dtypes differ: output {output.dtype}, "
                            f"input {input.dtype}")
        if (not input_split_sizes and not output_split_sizes and input.dim() > 0 and output.dim() > 0
                and input.shape[0] % p == 0 and output.shape[0] % p == 0 and input.shape[1:] == output.shape[1:]
                and self._sync_fast(opts, input, output)):
            # even splits (the common case): equal blocks, straight to the fast path, else the queue
            esz = input.element_size()
            sb, rb = [input.numel() * esz // p] * p, [output.numel() * esz // p] * p
            done = self._all_to_all_now(output, input, sb, rb)
            if done is not FALLBACK:
                return done
            return self._alltoallv("all_to_all", input, output, sb, rb, [output], False)
        # elements per dim-0 row (shape arithmetic: indexing a tensor costs more than the whole call)
        row_in = math.prod(input.shape[1:]) if input.dim() > 0 and input.shape[0] else 0
        row_out = math.prod(output.shape[1:]) if output.dim() > 0 and output.shape[0] else 0
        row = max(row_in, row_out, 1) if input.dim() > 1 or output.dim() > 1 else 1

        def splits(sizes: list[int], t: torch.Tensor, name: str) -> list[int]:
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

        s_in = splits(list(input_split_sizes), input, "input")
        s_out = splits(list(output_split_sizes), output, "output")
        esz = input.element_size()
        sb = [s * row * esz for s in s_in]
        rb = [s * row * esz for s in s_out]
        if self._sync_fast(opts, input, output):
            done = self._all_to_all_now(output, input, sb, rb)
            if done is not FALLBACK:
                return done
        return self._alltoallv("all_to_all", input, output, sb, rb, [output], _async(opts))

    alltoall_base = all_to_all_single

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

        return self._alltoallv("all_to_all", send, recv, sb, rb, list(output_tensors), _async(opts),
                               deliver=deliver)

    def _alltoallv(self, kind: str, inp: torch.Tensor, out: torch.Tensor, sb: list[int], rb: list[int],
                   outputs: list, async_op: bool, deliver: Callable[[], None] | None = None) -> AcclWork:
        p = self._size
        eng = self._engine_for("alltoallv", inp.dtype)
        op = self._new_op(kind, outputs)
        op.big = max(sum(sb), sum(rb)) >= self._big
        op.describe = lambda: f"{kind}({inp.dtype}, send bytes {sb}, recv bytes {rb}) #{op.seq}"
        state: dict = {}
        seg = self._seg

        # the byte matrix (what every rank sends to every other) is always exchanged: it fixes the
        # number of segment rounds, and lets every rank check that sends match receives.  It rides in
        # the header slot (the fast path's exchange) up to MATRIX_MAX_RANKS ranks; beyond, the slot
        # exchange checks the call and a second all-gather (every rank now knows it) brings the matrix.
        in_slot = p <= MATRIX_MAX_RANKS
        dcode = _DTYPE_CODE.get(inp.dtype, 99)

        def start_header() -> Request:
            HEADER.pack_into(self._hdr_buf, 0, _MAGIC, _KIND[kind], op.seq, dcode, 0, 0, 0, 0, p)
            if in_slot:
                self._pack_matrix(sb, rb)
            return MpiRequest([self._hdr_start()])

        def verify_header() -> None:
            if not self._hdr_agrees(4):
                self._verify_rows(self._hdr_all, words=4)
            if in_slot:
                state["rounds"], state["uniform"] = self._matrix_rounds(kind)

        def start_matrix() -> list[Request]:
            mine = torch.tensor(sb + rb, dtype=torch.int64)
            allm = torch.empty((p, 2 * p), dtype=torch.int64)
            state["allm"] = allm
            n = mine.numel() * 8
            sbuf = [MPI.buffer.fromaddress(mine.data_ptr(), n), n, MPI.BYTE]
            rbuf = [MPI.buffer.fromaddress(allm.data_ptr(), n * p), n, MPI.BYTE]
            return [MpiRequest([self._ctl.Iallgather(sbuf, rbuf)], keep=(mine, allm))]

        def verify_matrix() -> None:
            state["rounds"], state["uniform"] = self._matrix_rounds(kind, state["allm"].tolist())

        op.check = (start_header, verify_header)
        per_pair = max(1, seg // p)

        def stage0() -> list[Request]:
            if not in_slot:
                verify_matrix()
            src = _as_bytes(self._stage_in(inp, eng))
            dst = _as_bytes(out) if out.is_contiguous() and out.device.type == "cpu" else torch.empty(
                out.numel() * out.element_size(), dtype=torch.uint8)
            state["dst"] = dst
            if state["uniform"] and state["rounds"] == 1 and eng is self._mpi:
                # every rank sends the same to every rank, in one round: MPI's Alltoall (the fast path's
                # choice too: both decide on the all-gathered matrix, so all ranks make the same call)
                return [self._call(eng, "alltoall", sb[0] * p, src, dst)]
            sdis = [sum(sb[:j]) for j in range(p)]
            rdis = [sum(rb[:j]) for j in range(p)]
            reqs = []
            for k in range(state["rounds"]):
                lo = k * per_pair
                sc = [max(0, min(per_pair, s - lo)) for s in sb]
                rc = [max(0, min(per_pair, r - lo)) for r in rb]
                reqs.append(self._call(eng, "alltoallv", max(sum(sc), sum(rc)), src, sc,
                                       [d + lo for d in sdis], dst, rc, [d + lo for d in rdis]))
            return reqs

        def finish() -> None:
            dst = state["dst"]
            if deliver is not None:
                deliver()
            elif dst.data_ptr() != (out.data_ptr() if out.numel() else dst.data_ptr()):
                out.copy_(dst.view(out.dtype).view(out.shape))

        op.stages = [stage0] if in_slot else [start_matrix, stage0]
        op.finish = finish
        return self._submit(op, async_op)

    # ----------------------------------------------------------------- barrier
    def barrier(self, opts=None) -> AcclWork:
        eng = self._engine_for("barrier")
        op = self._new_op("barrier", [])
        op.describe = lambda: f"barrier #{op.seq}"
        if self.options.check:
            self._add_check_lazy(op, "barrier", None, 0, 0)
            # the header exchange is itself a full synchronisation
            op.stages = []
        else:
            op.stages = [lambda: [self._call(eng, "barrier", 0)]]
        return self._submit(op, _async(opts))

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """Barrier that names the ranks that did not arrive within ``timeout`` (rank 0 reports).

        ``dist.monitored_barrier`` itself accepts only gloo groups; call this method on the group.
        """
        secs = timeout.total_seconds() if timeout is not None else self._timeout_s
        tag = 0x7FFF0000 % (self._mpi.p2p[0].Get_attr(MPI.TAG_UB) or 32767)
        token = torch.zeros(1, dtype=torch.int64)
        p2p = self._mpi.p2p[0]
        if self._rank != 0:
            p2p.Isend([token.numpy(), MPI.INT64_T], 0, tag)
            ack = torch.zeros(1, dtype=torch.int64)
            req = p2p.Irecv([ack.numpy(), MPI.INT64_T], 0, tag + 1)
            wait_until(req.Test, secs, f"accl: monitored_barrier: rank {self._rank} waiting for the release "
                                       "from rank 0")
            return
        bufs = {r: torch.zeros(1, dtype=torch.int64) for r in range(1, self._size)}
        reqs = {r: p2p.Irecv([bufs[r].numpy(), MPI.INT64_T], r, tag) for r in bufs}
        limit = now() + secs
        missing = set(reqs)
        pause = Backoff().pause
        while missing and now() < limit:
            for r in list(missing):
                if reqs[r].Test():
                    missing.discard(r)
            if missing and not wait_all_ranks and now() >= limit:
                break
            if missing:
                pause()
        if missing:
            for r in missing:  # withdraw the receives so that no later message matches them
                reqs[r].Cancel()
                reqs[r].Wait()
            # the lead phrase is gloo's own, so scripts and tests written against gloo recognise it
            raise AcclTimeoutError(f"accl: Rank 0 timed out in monitoredBarrier after {secs:g} s: ranks "
                                   f"{sorted(missing)} did not reach the barrier")
        for r in bufs:
            p2p.Send([token.numpy(), MPI.INT64_T], r, tag + 1)

