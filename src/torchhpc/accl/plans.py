"""Collectives as plans: each collective's wire behaviour written once.

A :class:`Plan` is one torch-level collective call: its header (the :mod:`.wire` fields and, for
small all_reduce, broadcast, all_gather and reduce_scatter calls on the MPI engine, the data itself in
the slot payload, so that the header exchange is the whole collective; for all_to_all, the byte
matrix and, when every rank's sends fit after it, the sends), its data stages (the engine calls, segment by
segment) and its finish (copy-back, AVG division).  The executor (:mod:`.executor`) runs a plan
either inline in the caller's thread or from the queue and progress thread; both call the same
``pack``/``verified``/``stage``/``finish`` methods with a :class:`~.engine.Mode` the executor picks
from the call alone, so ranks taking either path make the same MPI calls.

Protocol of a plan, in order (``header`` false skips the first two):

1. ``pack(hx, seq)``: write this call's header (and payload) into the exchange's slot.
2. ``verified(hx)``: every rank agreed; use what the slots carried (reduce payloads, split matrix).
3. ``stage(k, ctx, mode)`` for k = 0, 1, ...: start stage ``k``'s engine calls and return their
   requests; stage ``k + 1`` starts once they completed; ``None`` ends the data phase.
4. ``finish()``: deliver the results into the caller's tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import accumulate
from typing import Protocol

import torch
from mpi4py import MPI

from ..errors import MismatchError
from . import wire
from .engine import CollectiveEngine, Mode, Request
from .header import HeaderExchange, Reduction
from .mpi_engine import MpiRequest
from .reduction import op_name
from .tensors import as_bytes, host, ranges, stage_in, stage_out

__all__ = ["Context", "Plan", "AllReduce", "Broadcast", "Reduce", "GatherLike", "Scatter", "ReduceScatter",
           "AllToAll", "Barrier", "MATRIX_MAX_RANKS"]

#: all_to_all carries its send/recv byte-matrix row (2 x p int64) in the header slot up to this size
MATRIX_MAX_RANKS = wire.PAYLOAD_BYTES // 16

_K = {k: wire.kind_code(k) for k in wire.KINDS}
_pack = wire.pack_header
_K_BROADCAST, _K_REDUCE_SCATTER = _K["broadcast"], _K["reduce_scatter"]
_PAYLOAD = wire.PAYLOAD_BYTES


def _rides(ctx: Context, eng: CollectiveEngine, header: bool, nbytes: int) -> bool:
    """Whether a call's ``nbytes`` of data ride in its header slot (on the MPI engine, when the header is
    exchanged and the data fit the payload area): the exchange is then the whole collective."""
    return header and nbytes <= _PAYLOAD and eng is ctx.mpi


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
    """all_reduce (and all_reduce_coalesced: several tensors reduced as one flat buffer).  Payloads up
    to one slot ride in the header exchange and are reduced locally, in rank order, by every rank."""

    buf: torch.Tensor | None = None

    def __init__(self, ctx: Context, eng: CollectiveEngine, ts: list[torch.Tensor], red: Reduction,
                 kind: str, check: bool) -> None:
        # (the base initialiser is inlined: this is the hottest constructor)
        numel = ts[0].numel() if len(ts) == 1 else sum(t.numel() for t in ts)
        nbytes = numel * red.esz
        fused = self.fused = _rides(ctx, eng, check, nbytes)
        self.rank, self.p, self.eng, self.outputs = ctx.rank, ctx.size, eng, ts
        self.header = fused or ctx.header_needed(eng, nbytes)
        self.big = nbytes >= ctx.big
        self.kind, self.kcode, self.ts, self.red, self.numel, self.nbytes = kind, _K[kind], ts, red, numel, nbytes

    def _gather(self) -> torch.Tensor:
        ts = self.ts
        if len(ts) == 1:
            return stage_in(ts[0], self.eng)
        dev = ts[0].device if self.eng.accepts(ts[0].device) else torch.device("cpu")
        return torch.cat([t.reshape(-1) for t in ts]).to(dev)

    def pack(self, hx: HeaderExchange, seq: int) -> None:
        red = self.red
        _pack(hx.mine, self.kcode, seq, red.dcode, red.ocode, 0, self.nbytes, self.numel)
        if self.fused:
            ts = self.ts
            buf = ts[0]
            if len(ts) != 1 or not buf.is_cpu or not buf.is_contiguous():
                buf = self._gather()
                if not buf.is_cpu:
                    buf = buf.cpu()
            self.buf = buf
            hx.put_payload(buf.data_ptr(), self.nbytes)

    def verified(self, hx: HeaderExchange) -> None:
        if self.fused:
            hx.reduce_payloads(self.red, self.nbytes, self.buf.data_ptr())  # type: ignore[union-attr]

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if k or self.fused:
            return None
        buf = self.buf = self._gather()
        esz, numel, op = self.red.esz, self.numel, self.red.engine_op
        per = ctx.per(esz)
        if numel <= per:
            return [ctx.call(self.eng, "allreduce", self.nbytes, mode, buf, op)] if numel else []
        return [ctx.call(self.eng, "allreduce", (b - a) * esz, mode, buf[a:b], op) for a, b in ranges(numel, per)]

    def finish(self) -> None:
        buf = self.buf
        assert buf is not None
        if self.red.avg:
            buf.div_(self.p)
        ts = self.ts
        if len(ts) == 1:
            if buf is not ts[0]:
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

    def __init__(self, ctx: Context, eng: CollectiveEngine, t: torch.Tensor, root: int, header: bool) -> None:
        self.t, self.root, self.numel, self.esz, nbytes = t, root, t.numel(), t.element_size(), t.nbytes
        self.rank, self.p, self.eng, self.header, self.outputs = ctx.rank, ctx.size, eng, header, [t]
        self.big = nbytes >= ctx.big
        self.fused = _rides(ctx, eng, header, nbytes)  # the root's data in its slot
        self.buf: torch.Tensor | None = None

    def pack(self, hx: HeaderExchange, seq: int) -> None:
        t = self.t
        _pack(hx.mine, _K_BROADCAST, seq, wire.dtype_code(t.dtype), 0, self.root, t.nbytes, self.numel)
        if self.fused and self.rank == self.root:
            src = host(t)
            hx.put_payload(src.data_ptr(), src.nbytes)

    def verified(self, hx: HeaderExchange) -> None:
        if self.fused and self.rank != self.root:
            buf = self.buf = host(self.t, copy=False)
            hx.get_payload(self.root, buf.data_ptr(), buf.nbytes)

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if k or self.fused:
            return None
        buf = self.buf = stage_in(self.t, self.eng, copy=(self.rank == self.root))
        esz, numel = self.esz, self.numel
        per = ctx.per(esz)
        if numel <= per:
            return [ctx.call(self.eng, "broadcast", numel * esz, mode, buf, self.root)] if numel else []
        return [ctx.call(self.eng, "broadcast", (b - a) * esz, mode, buf[a:b], self.root)
                for a, b in ranges(numel, per)]

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
    """all_gather and gather: ``rows`` is the destination of p x n contiguous elements, any shape (a
    tensor, or a callable making it at the data stage; None off-root for gather), ``deliver(rows)``
    copies it to the caller's outputs when they are not that memory."""

    def __init__(self, ctx: Context, eng: CollectiveEngine, kind: str, inp: torch.Tensor,
                 rows: torch.Tensor | Callable[[], torch.Tensor | None], deliver: Callable[[torch.Tensor], None] | None,
                 root: int, outputs: list, header: bool) -> None:
        self.kind, self.kcode, self.inp, self.rows, self.deliver, self.root = kind, _K[kind], inp, rows, deliver, root
        self.numel, self.esz = inp.numel(), inp.element_size()
        self.rank, self.p, self.eng, self.header, self.outputs = ctx.rank, ctx.size, eng, header, outputs
        self.big = self.numel * self.esz * ctx.size >= ctx.big
        # all_gather of at most one slot payload per rank: the header exchange carries the data
        self.fused = kind == "all_gather" and _rides(ctx, eng, header, inp.nbytes)
        self.dst: torch.Tensor | None = None
        self.src: torch.Tensor | None = None

    def pack(self, hx: HeaderExchange, seq: int) -> None:
        numel, inp = self.numel, self.inp
        _pack(hx.mine, self.kcode, seq, wire.dtype_code(inp.dtype), 0, self.root, numel * self.esz, numel)
        if self.fused:
            src = self.src = host(inp)
            hx.put_payload(src.data_ptr(), src.nbytes)

    def verified(self, hx: HeaderExchange) -> None:
        if self.fused:
            dst = self.dst = _made(self.rows)
            out = host(dst, copy=False)  # type: ignore[arg-type]
            n, addr = self.numel * self.esz, out.data_ptr()
            for r in range(self.p):
                hx.get_payload(r, addr + r * n, n)
            stage_out(out, dst)  # type: ignore[arg-type]

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if k or self.fused:
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
    the data stage) into ``out`` (n elements)."""

    kind = "reduce_scatter"

    def __init__(self, ctx: Context, eng: CollectiveEngine, out: torch.Tensor,
                 rows: torch.Tensor | Callable[[], torch.Tensor], red: Reduction, header: bool) -> None:
        self.out, self.rows, self.red, self.numel = out, rows, red, out.numel()
        self.rank, self.p, self.eng, self.header, self.outputs = ctx.rank, ctx.size, eng, header, [out]
        self.big = self.numel * red.esz * ctx.size >= ctx.big
        # a whole input of at most one slot payload rides in the header; each rank reduces its own block
        self.fused = _rides(ctx, eng, header, self.numel * red.esz * ctx.size)
        self.dst: torch.Tensor | None = None

    def pack(self, hx: HeaderExchange, seq: int) -> None:
        red, numel = self.red, self.numel
        _pack(hx.mine, _K_REDUCE_SCATTER, seq, red.dcode, red.ocode, 0, numel * red.esz, numel)
        if self.fused:
            src = self.src = host(_made(self.rows))  # type: ignore[arg-type]
            hx.put_payload(src.data_ptr(), src.nbytes)

    def verified(self, hx: HeaderExchange) -> None:
        if self.fused:
            dst = self.dst = host(self.out, copy=False)
            n = self.numel * self.red.esz
            hx.reduce_payloads(self.red, n, dst.data_ptr(), self.rank * n)

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if k or self.fused:
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


# --------------------------------------------------------------------------- all_to_all


class AllToAll(Plan):
    """all_to_all of byte counts ``sb`` (to each rank) and ``rb`` (from each rank).  The send/receive
    byte matrix is always exchanged (in the header slot up to MATRIX_MAX_RANKS ranks, else by a second
    all-gather): it fixes the number of segment rounds and lets every rank check that sends match
    receives.  One round of equal blocks everywhere is one MPI Alltoall, else Alltoallv rounds."""

    kind = "all_to_all"
    compare = wire.COMPARE_CALL  # sizes are checked on the matrix

    def __init__(self, ctx: Context, eng: CollectiveEngine, inp: torch.Tensor, out: torch.Tensor, sb: list[int],
                 rb: list[int], outputs: list, deliver: Callable[[], None] | None = None) -> None:
        self.inp, self.out, self.sb, self.rb, self.deliver = inp, out, sb, rb, deliver
        super().__init__(ctx, eng, True, max(sum(sb), sum(rb)) >= ctx.big, outputs)
        self.in_slot = ctx.size <= MATRIX_MAX_RANKS
        # small sends ride in the slot after the matrix; the call is fused when every rank's did (the
        # matrix, agreed by all, says so)
        self.slot_data = self.in_slot and eng is ctx.mpi
        self.packs_data = self.slot_data and sum(sb) <= _PAYLOAD - 16 * ctx.size
        self.fused = False
        self.rounds, self.uniform = 1, False
        self.seg = ctx.seg
        self.allm: torch.Tensor | None = None
        self.dst: torch.Tensor | None = None
        self.src: torch.Tensor | None = None

    def fields(self) -> tuple[int, int, int, int, int, int]:
        return wire.dtype_code(self.inp.dtype), 0, 0, 0, 0, self.p

    def pack(self, hx: HeaderExchange, seq: int) -> None:
        super().pack(hx, seq)
        if self.in_slot:
            hx.put_words(self.sb + self.rb)
            if self.packs_data:
                src = self.src = host(self.inp)
                hx.put_payload(src.data_ptr(), src.nbytes, 16 * self.p)

    def verified(self, hx: HeaderExchange) -> None:
        if not self.in_slot:
            return
        sb, p = self.sb, self.p
        if self.sb == self.rb and len(set(sb)) == 1 and hx.payload_equal(16 * p):  # the common even split
            self.rounds, self.uniform = max(1, math.ceil(sb[0] / max(1, self.seg // p))), True
            if self.packs_data:  # every rank's matrix is this one: every rank packed its data
                self._unpack(hx, [sb] * p)
        else:
            rows = hx.payload_words(2 * p)
            self._rounds(rows)
            if self.slot_data and all(sum(row[:p]) <= _PAYLOAD - 16 * p for row in rows):
                self._unpack(hx, [row[:p] for row in rows])

    def _destination(self) -> torch.Tensor:
        """Where the blocks arrive: the caller's output when MPI can write it directly, else a host buffer."""
        out = self.out
        dst = self.dst = out if out.is_cpu and out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype)
        return dst

    def _unpack(self, hx: HeaderExchange, send: list[list[int]]) -> None:
        """Take this rank's blocks from every rank's slot (``send``: the agreed send byte matrix)."""
        me, p = self.rank, self.p
        addr = self._destination().data_ptr()
        for r in range(p):
            row = send[r]
            hx.get_payload(r, addr, row[me], 16 * p + sum(row[:me]))
            addr += row[me]
        self.fused = True

    def _rounds(self, rows: list[list[int]]) -> None:
        """Check the gathered matrices (send of i to j == recv of j from i); set rounds and uniform."""
        p = self.p
        send = [row[:p] for row in rows]
        recv = [row[p:] for row in rows]
        bad = [(i, j) for i in range(p) for j in range(p) if send[i][j] != recv[j][i]]
        if bad:
            i, j = bad[0]
            raise MismatchError(
                f"accl: {self.kind} split sizes do not match across ranks: rank {i} sends {send[i][j]} bytes "
                f"to rank {j}, which expects {recv[j][i]} bytes from it ({len(bad)} mismatched pairs)")
        self.rounds = max(1, math.ceil(max(max(r) for r in send) / max(1, self.seg // p)))
        self.uniform = len({c for r in send for c in r}) == 1

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if self.fused:
            return None
        if not self.in_slot:
            if k == 0:  # the matrix by a second all-gather on the control communicator
                mine = torch.tensor(self.sb + self.rb, dtype=torch.int64)
                allm = self.allm = torch.empty((self.p, 2 * self.p), dtype=torch.int64)
                n = mine.numel() * 8
                sbuf = [MPI.buffer.fromaddress(mine.data_ptr(), n), n, MPI.BYTE]
                rbuf = [MPI.buffer.fromaddress(allm.data_ptr(), n * self.p), n, MPI.BYTE]
                return [MpiRequest([ctx.ctl.Iallgather(sbuf, rbuf)], keep=(mine, allm))]
            if k == 1:
                self._rounds(self.allm.tolist())  # type: ignore[union-attr]
            k -= 1
        if k:
            return None
        return self._data(ctx, mode)

    def _data(self, ctx: Context, mode: Mode) -> list[Request]:
        inp, sb, rb, p = self.inp, self.sb, self.rb, self.p
        src = stage_in(inp, self.eng)
        dst = self._destination()
        if self.uniform and self.rounds == 1 and self.eng is ctx.mpi:
            return [ctx.call(self.eng, "alltoall", sb[0] * p, mode, src, dst)]
        per_pair = max(1, self.seg // p)
        sdis = list(accumulate(sb[:-1], initial=0))
        rdis = list(accumulate(rb[:-1], initial=0))
        src, dst = as_bytes(src), as_bytes(dst)  # alltoallv counts bytes
        reqs = []
        for r in range(self.rounds):
            lo = r * per_pair
            sc = [max(0, min(per_pair, s - lo)) for s in sb]
            rc = [max(0, min(per_pair, x - lo)) for x in rb]
            reqs.append(ctx.call(self.eng, "alltoallv", max(sum(sc), sum(rc)), mode, src, sc,
                                 [d + lo for d in sdis], dst, rc, [d + lo for d in rdis]))
        return reqs

    def finish(self) -> None:
        if self.deliver is not None:
            self.deliver()
            return
        dst, out = self.dst, self.out
        if dst is not out and out.numel():
            out.copy_(dst.view(out.shape))  # type: ignore[union-attr]

    def describe(self, seq: int) -> str:
        return f"all_to_all({self.inp.dtype}, send bytes {self.sb}, recv bytes {self.rb}) #{seq}"


# --------------------------------------------------------------------------- barrier


class Barrier(Plan):
    """barrier: the header exchange when checked (itself a full synchronisation), else MPI's."""

    kind = "barrier"

    def __init__(self, ctx: Context, eng: CollectiveEngine, header: bool) -> None:
        super().__init__(ctx, eng, header, False, [])

    def fields(self) -> tuple[int, int, int, int, int, int]:
        return 0, 0, 0, 0, 0, 0

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if k or self.header:
            return None
        return [ctx.call(self.eng, "barrier", 0, mode)]
