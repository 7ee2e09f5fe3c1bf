"""Collectives as plans, and the plan protocol every call the executor runs follows.

A plan is one torch-level collective call: its header (the :mod:`.wire` fields), its data stages (the
engine calls, segment by segment) and its finish (copy-back, AVG division).  The executor
(:mod:`.executor`) runs a plan either inline in the caller's thread or from the queue and progress
thread; both call the same ``pack``/``verified``/``stage``/``finish`` methods with a
:class:`~.engine.Mode` the executor picks from the call alone, so ranks taking either path make the same
calls.

Two kinds of plan follow this protocol.  The MPI engine's all_reduce, broadcast, all_gather,
reduce_scatter, all_to_all and barrier are the compiled core's calls (:mod:`.calls`: their data ride in
the header slot when small).  The classes here are the other collectives: every collective on the ACCL
engine (its driver moves the data; nothing rides in the slot), and reduce, gather and scatter on either
engine.

Protocol of a plan, in order (``header`` false skips the first two):

1. ``pack(hx, seq)``: write this call's header (and payload) into the exchange's slot.
2. ``verified(hx)``: every rank agreed; use what the slots carried (reduce payloads, split matrix).
3. ``stage(k, ctx, mode)`` for k = 0, 1, ...: start stage ``k``'s engine calls and return their
   requests; stage ``k + 1`` starts once they completed; ``None`` ends the data phase.
4. ``finish()``: deliver the results into the caller's tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from mpi4py import MPI

from . import wire
from .engine import CollectiveEngine, Mode, Request
from .header import HeaderExchange, Reduction
from .reduction import op_name
from .tensors import ranges, stage_in, stage_out

__all__ = ["Context", "Plan", "AllReduce", "Broadcast", "Reduce", "GatherLike", "Scatter", "ReduceScatter"]

_K = {k: wire.kind_code(k) for k in wire.KINDS}
_pack = wire.pack_header


def _made(x: torch.Tensor | Callable[[], torch.Tensor | None] | None) -> torch.Tensor | None:
    """A plan's buffer given as a tensor, or as a callable that makes it when it is needed."""
    return x if x is None or type(x) is torch.Tensor else x()  # type: ignore[operator]


def _reduced(buf: torch.Tensor | None, red: Reduction, p: int, t: torch.Tensor) -> None:
    """Deliver a reduction's result ``buf`` into ``t``, divided by the group size ``p`` for AVG."""
    assert buf is not None
    if red.avg:
        buf.div_(p)
    stage_out(buf, t)


class Context(Protocol):
    """What a plan needs from the group running it (the executor provides it)."""

    rank: int
    size: int
    seg: int  # max_segment_bytes
    big: int  # threaded_min_bytes
    mpi: CollectiveEngine
    ctl: MPI.Comm

    def call(self, eng: CollectiveEngine, fn: str, nbytes: int, mode: Mode | None, *args) -> Request:
        """Make one engine call (accounted in the group's stats)."""
        ...

    def per(self, elem: int, parts: int = 1) -> int:
        """Elements per segment so that ``parts`` blocks of them fit one segment."""
        ...

    def header_needed(self, eng: CollectiveEngine, total_bytes: int) -> bool:
        """Whether a collective moving ``total_bytes`` on ``eng`` exchanges the header."""
        ...


class Plan:
    """Base of the collective plans (see the module docstring for the protocol)."""

    kind = ""
    compare = wire.COMPARE_ALL  # header fields every rank must agree on

    source_rank = -1  # a receive from any source: the rank it came from
    fused = False  # the data rode in the header slots: the exchange was the whole collective

    def __init__(self, ctx: Context, eng: CollectiveEngine, header: bool, big: bool, outputs: list) -> None:
        self.rank, self.p = ctx.rank, ctx.size
        self.eng = eng
        self.header = header  # exchange the consistency header first
        self.big = big  # large enough for MPI's blocking algorithms on the worker thread when async
        self.outputs = outputs

    def fields(self) -> tuple[int, int, int, int, int, int]:
        """(dtype, op, root, nbytes, numel, extra) codes of the header."""
        raise NotImplementedError

    def pack(self, hx: HeaderExchange, seq: int) -> None:
        """Write this call's header (and payload) into the exchange's slot."""
        _pack(hx.mine, _K[self.kind], seq, *self.fields())

    def verified(self, hx: HeaderExchange) -> None:  # noqa: B027 - most plans need nothing from the slots
        """Every rank agreed on the header; take what the slots carried."""

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        raise NotImplementedError

    def finish(self) -> None:  # noqa: B027 - optional
        """Deliver results to the caller's tensors."""

    def describe(self, seq: int) -> str:
        return f"{self.kind} #{seq}"



# --------------------------------------------------------------------------- all_reduce


class AllReduce(Plan):
    """all_reduce (and all_reduce_coalesced: several tensors reduced as one flat buffer), in segments."""

    buf: torch.Tensor | None = None

    def __init__(self, ctx: Context, eng: CollectiveEngine, ts: list[torch.Tensor], red: Reduction,
                 kind: str) -> None:
        numel = ts[0].numel() if len(ts) == 1 else sum(t.numel() for t in ts)
        nbytes = numel * red.esz
        super().__init__(ctx, eng, ctx.header_needed(eng, nbytes), nbytes >= ctx.big, ts)
        self.kind, self.kcode, self.ts, self.red, self.numel, self.nbytes = kind, _K[kind], ts, red, numel, nbytes

    def fields(self) -> tuple[int, int, int, int, int, int]:
        return self.red.dcode, self.red.ocode, 0, self.nbytes, self.numel, 0

    def pack(self, hx: HeaderExchange, seq: int) -> None:
        _pack(hx.mine, self.kcode, seq, *self.fields())

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if k:
            return None
        ts = self.ts
        if len(ts) == 1:
            buf = stage_in(ts[0], self.eng)
        else:
            dev = ts[0].device if self.eng.accepts(ts[0].device) else torch.device("cpu")
            buf = torch.cat([t.reshape(-1) for t in ts]).to(dev)
        self.buf = buf
        esz, op = self.red.esz, self.red.engine_op
        return [ctx.call(self.eng, "allreduce", (b - a) * esz, mode, buf[a:b], op)
                for a, b in ranges(self.numel, ctx.per(esz)) if b > a]

    def finish(self) -> None:
        buf = self.buf
        assert buf is not None
        if self.red.avg:
            buf.div_(self.p)
        ts = self.ts
        if len(ts) == 1:
            stage_out(buf, ts[0])
            return
        off = 0
        for t in ts:
            t.copy_(buf[off: off + t.numel()].view(t.shape))
            off += t.numel()

    def describe(self, seq: int) -> str:
        return f"{self.kind}({self.red.dtype}, {self.numel} elements, {op_name(self.red.op)}) #{seq}"


# --------------------------------------------------------------------------- broadcast / reduce


class Broadcast(Plan):
    """broadcast from ``root``, in segments."""

    kind = "broadcast"

    def __init__(self, ctx: Context, eng: CollectiveEngine, t: torch.Tensor, root: int) -> None:
        self.t, self.root, self.numel, self.esz = t, root, t.numel(), t.element_size()
        super().__init__(ctx, eng, ctx.header_needed(eng, t.nbytes), t.nbytes >= ctx.big, [t])
        self.buf: torch.Tensor | None = None

    def fields(self) -> tuple[int, int, int, int, int, int]:
        return wire.dtype_code(self.t.dtype), 0, self.root, self.t.nbytes, self.numel, 0

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if k:
            return None
        buf = self.buf = stage_in(self.t, self.eng, copy=(self.rank == self.root))
        esz = self.esz
        return [ctx.call(self.eng, "broadcast", (b - a) * esz, mode, buf[a:b], self.root)
                for a, b in ranges(self.numel, ctx.per(esz)) if b > a]

    def finish(self) -> None:
        if self.rank != self.root:
            stage_out(self.buf, self.t)  # type: ignore[arg-type]

    def describe(self, seq: int) -> str:
        return f"broadcast({self.t.dtype}, {self.numel} elements, root {self.root}) #{seq}"


class Reduce(Plan):
    """reduce to ``root``, in segments (non-roots reduce from a copy: MPI may use their buffer)."""

    kind = "reduce"

    def __init__(self, ctx: Context, eng: CollectiveEngine, t: torch.Tensor, red: Reduction, root: int,
                 header: bool) -> None:
        self.t, self.red, self.root, self.numel = t, red, root, t.numel()
        super().__init__(ctx, eng, header, self.numel * red.esz >= ctx.big, [t])
        self.buf: torch.Tensor | None = None

    def fields(self) -> tuple[int, int, int, int, int, int]:
        return self.red.dcode, self.red.ocode, self.root, self.numel * self.red.esz, self.numel, 0

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if k:
            return None
        buf = stage_in(self.t, self.eng)
        if buf.data_ptr() == self.t.data_ptr() and self.rank != self.root:
            buf = buf.clone()  # keep the caller's input intact
        self.buf = buf
        esz, op = self.red.esz, self.red.engine_op
        return [ctx.call(self.eng, "reduce", (b - a) * esz, mode, buf[a:b], op, self.root)
                for a, b in ranges(self.numel, ctx.per(esz)) if b > a]

    def finish(self) -> None:
        if self.rank == self.root:
            _reduced(self.buf, self.red, self.p, self.t)

    def describe(self, seq: int) -> str:
        return (f"reduce({self.red.dtype}, {self.numel} elements, {op_name(self.red.op)}, root {self.root}) "
                f"#{seq}")


# --------------------------------------------------------------------------- gathers / scatter


class GatherLike(Plan):
    """all_gather (ACCL engine) and gather: ``rows`` is the destination of p x n contiguous elements, any shape (a
    tensor, or a callable making it at the data stage; None off-root for gather), ``deliver(rows)``
    copies it to the caller's outputs when they are not that memory."""

    def __init__(self, ctx: Context, eng: CollectiveEngine, kind: str, inp: torch.Tensor,
                 rows: torch.Tensor | Callable[[], torch.Tensor | None], deliver: Callable[[torch.Tensor], None] | None,
                 root: int, outputs: list, header: bool) -> None:
        self.kind, self.kcode, self.inp, self.rows, self.deliver, self.root = kind, _K[kind], inp, rows, deliver, root
        self.numel, self.esz = inp.numel(), inp.element_size()
        self.rank, self.p, self.eng, self.header, self.outputs = ctx.rank, ctx.size, eng, header, outputs
        self.big = self.numel * self.esz * ctx.size >= ctx.big
        self.dst: torch.Tensor | None = None

    def pack(self, hx: HeaderExchange, seq: int) -> None:
        numel, inp = self.numel, self.inp
        _pack(hx.mine, self.kcode, seq, wire.dtype_code(inp.dtype), 0, self.root, numel * self.esz, numel)

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if k:
            return None
        src = stage_in(self.inp, self.eng)
        dst = self.dst = _made(self.rows)
        esz, numel, p = self.esz, self.numel, self.p
        per = ctx.per(esz, p)
        if numel <= per:  # one call on the whole rows
            if self.kind == "all_gather":
                return [ctx.call(self.eng, "allgather", numel * esz * p, mode, src, dst)]
            return [ctx.call(self.eng, "gather", numel * esz * p, mode, src, dst, self.root)]
        rows = dst.view(p, numel) if dst is not None else None
        reqs = []
        for a, b in ranges(numel, per):
            part = rows[:, a:b] if rows is not None else None
            if self.kind == "all_gather":
                reqs.append(ctx.call(self.eng, "allgather", (b - a) * esz * p, mode, src[a:b], part))
            else:
                reqs.append(ctx.call(self.eng, "gather", (b - a) * esz * p, mode, src[a:b], part, self.root))
        return reqs

    def finish(self) -> None:
        if self.deliver is not None and self.dst is not None:
            self.deliver(self.dst)

    def describe(self, seq: int) -> str:
        return f"{self.kind}({self.inp.dtype}, {self.numel} elements per rank) #{seq}"


class Scatter(Plan):
    """scatter from ``root``'s list (``ins``, empty off-root) into ``out``."""

    kind = "scatter"

    def __init__(self, ctx: Context, eng: CollectiveEngine, out: torch.Tensor, ins: list[torch.Tensor], root: int,
                 header: bool) -> None:
        self.out, self.ins, self.root, self.numel, self.esz = out, ins, root, out.numel(), out.element_size()
        super().__init__(ctx, eng, header, self.numel * self.esz * ctx.size >= ctx.big, [out])
        self.dst: torch.Tensor | None = None

    def fields(self) -> tuple[int, int, int, int, int, int]:
        return wire.dtype_code(self.out.dtype), 0, self.root, self.numel * self.esz, self.numel, 0

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if k:
            return None
        src = torch.stack([i.reshape(-1) for i in self.ins]).cpu() if self.ins else None
        dst = self.dst = stage_in(self.out, self.eng, copy=False)
        esz, p = self.esz, self.p
        return [ctx.call(self.eng, "scatter", (b - a) * esz * p, mode,
                         src[:, a:b] if src is not None else None, dst[a:b], self.root)
                for a, b in ranges(self.numel, ctx.per(esz, p)) if b > a]

    def finish(self) -> None:
        stage_out(self.dst, self.out)  # type: ignore[arg-type]

    def describe(self, seq: int) -> str:
        return f"scatter({self.out.dtype}, {self.numel} elements per rank, root {self.root}) #{seq}"


# --------------------------------------------------------------------------- reduce_scatter


class ReduceScatter(Plan):
    """reduce_scatter of ``rows`` (p x n contiguous elements, any shape; a tensor, or a callable making it at
    the data stage) into ``out`` (n elements), on the ACCL engine."""

    kind = "reduce_scatter"

    def __init__(self, ctx: Context, eng: CollectiveEngine, out: torch.Tensor,
                 rows: torch.Tensor | Callable[[], torch.Tensor], red: Reduction) -> None:
        self.out, self.rows, self.red, self.numel = out, rows, red, out.numel()
        total = self.numel * red.esz * ctx.size
        super().__init__(ctx, eng, ctx.header_needed(eng, total), total >= ctx.big, [out])
        self.dst: torch.Tensor | None = None

    def fields(self) -> tuple[int, int, int, int, int, int]:
        return self.red.dcode, self.red.ocode, 0, self.numel * self.red.esz, self.numel, 0

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if k:
            return None
        src = _made(self.rows)
        dst = self.dst = stage_in(self.out, self.eng, copy=False)
        esz, numel, p, op = self.red.esz, self.numel, self.p, self.red.engine_op
        per = ctx.per(esz, p)
        if numel <= per:
            return [ctx.call(self.eng, "reduce_scatter", numel * esz * p, mode, src, dst, op)] if numel else []
        rows = src.view(p, numel)
        return [ctx.call(self.eng, "reduce_scatter", (b - a) * esz * p, mode, rows[:, a:b].contiguous(), dst[a:b],
                         op) for a, b in ranges(numel, per)]

    def finish(self) -> None:
        _reduced(self.dst, self.red, self.p, self.out)

    def describe(self, seq: int) -> str:
        return (f"reduce_scatter({self.red.dtype}, {self.numel} elements per rank, {op_name(self.red.op)}) "
                f"#{seq}")
