"""The MPI engine's collectives: the compiled core's calls, with the staging the adapter needs around them.

Each collective's wire behaviour on the MPI engine (its header words, whether its data ride in the header
slot, its MPI calls and segments) lives in the core (``_core.c``), once; the executor drives a core call
inline (``Group.run``) or from its queue through the plan protocol of :mod:`.plans`.  What stays here is
per-rank and never reaches the wire: which buffer the core reads and writes (the caller's own memory when
it is a contiguous CPU tensor, else a staged host copy) and what is delivered afterwards (copy-back,
AVG's division).  Staging waits for the call's turn in the queue (:class:`Deferred`), so a queued call
reads its input only after the calls issued before it completed, as on a CUDA stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from . import wire
from .header import HeaderExchange, Reduction
from .tensors import host, stage_in, stage_out

if TYPE_CHECKING:
    from .executor import Executor

__all__ = ["Deferred", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "barrier",
           "MATRIX_MAX_RANKS"]

#: all_to_all carries its send/recv byte-matrix row (2 x p int64) in the header slot up to this many ranks
MATRIX_MAX_RANKS = wire.PAYLOAD_BYTES // 16

_PAYLOAD = wire.PAYLOAD_BYTES
_K = {k: wire.kind_code(k) for k in wire.KINDS}
_K_BROADCAST, _K_ALL_GATHER, _K_REDUCE_SCATTER = _K["broadcast"], _K["all_gather"], _K["reduce_scatter"]
_K_ALL_TO_ALL, _K_BARRIER = _K["all_to_all"], _K["barrier"]

Buffer = torch.Tensor | Callable[[], torch.Tensor]


def _cpu(t: torch.Tensor) -> bool:
    return t.is_cpu and t.is_contiguous()


class Deferred:
    """A core call whose buffers are staged when its turn comes (its first plan method), not when it is
    issued; every other plan method is the core call's."""

    __slots__ = ("_make", "_call", "header", "big", "compare", "outputs", "eng", "_what")
    source_rank = -1

    def __init__(self, make: Callable[[], object], header: bool, big: bool, outputs: list, eng: object,
                 what: str, compare: int = wire.COMPARE_ALL) -> None:
        self._make, self._call, self._what = make, None, what
        self.header, self.big, self.compare, self.outputs, self.eng = header, big, compare, outputs, eng

    def _made(self):  # noqa: ANN202 - the core's Call
        if self._call is None:
            self._call = self._make()
        return self._call

    @property
    def fused(self) -> bool:
        return bool(self._call is not None and self._call.fused)

    def pack(self, hx: HeaderExchange, seq: int) -> None:
        self._made().pack(hx, seq)

    def verified(self, hx: HeaderExchange) -> None:
        self._made().verified(hx)

    def stage(self, k: int, ctx: object, mode: int) -> list | None:
        return self._made().stage(k, ctx, mode)

    def finish(self) -> None:
        self._made().finish()

    def describe(self, seq: int) -> str:
        return self._call.describe(seq) if self._call is not None else f"{self._what} #{seq}"


def all_reduce(ex: Executor, ts: list[torch.Tensor], red: Reduction, kind: str) -> object:
    """all_reduce (and all_reduce_coalesced: several tensors reduced as one flat buffer)."""
    core, mpi, p = ex.core, ex.mpi, ex.size
    t = ts[0]
    numel = t.numel() if len(ts) == 1 else sum(x.numel() for x in ts)
    nbytes = numel * red.esz
    kcode = _K[kind]
    if len(ts) == 1 and t.is_cpu and t.is_contiguous():  # the caller's own memory
        post = (lambda: t.div_(p)) if red.avg else None
        return core.all_reduce(kcode, t, ts, mpi, post, t.data_ptr(), numel, red.core, None, None)
    header, big = core.flags(nbytes)

    def make() -> object:
        if len(ts) == 1:
            buf = stage_in(t, mpi)
        else:
            dev = t.device if mpi.accepts(t.device) else torch.device("cpu")
            buf = torch.cat([x.reshape(-1) for x in ts]).to(dev)
        if header and nbytes <= _PAYLOAD and not buf.is_cpu:  # riding in the slot needs host memory
            buf = buf.cpu()

        def post() -> None:
            if red.avg:
                buf.div_(p)
            if len(ts) == 1:
                stage_out(buf, t)
                return
            off = 0
            for x in ts:
                x.copy_(buf[off: off + x.numel()].view(x.shape))
                off += x.numel()

        return core.all_reduce(kcode, buf, ts, mpi, post, buf.data_ptr(), numel, red.core, header, big)

    return Deferred(make, header, big, ts, mpi, f"{kind}({red.dtype}, {numel} elements)")


def broadcast(ex: Executor, t: torch.Tensor, root: int) -> object:
    """broadcast of ``t`` from ``root``."""
    core, mpi, nbytes = ex.core, ex.mpi, t.nbytes
    dcode = wire.dtype_code(t.dtype)
    if t.is_cpu and t.is_contiguous():
        return core.broadcast(_K_BROADCAST, t, [t], mpi, None, t.data_ptr(), t.numel(), t.element_size(), dcode,
                              root, None, None)
    header, big = core.flags(nbytes)
    is_root = ex.rank == root

    def make() -> object:
        if header and nbytes <= _PAYLOAD:
            buf = host(t, copy=is_root)
        else:
            buf = stage_in(t, mpi, copy=is_root)
        post = None if is_root else (lambda: stage_out(buf, t))
        return core.broadcast(_K_BROADCAST, buf, [t], mpi, post, buf.data_ptr(), t.numel(), t.element_size(),
                              dcode, root, header, big)

    return Deferred(make, header, big, [t], mpi, f"broadcast({t.dtype}, {t.numel()} elements, root {root})")


def all_gather(ex: Executor, inp: torch.Tensor, rows: Buffer, deliver: Callable[[torch.Tensor], None] | None,
               outputs: list) -> object:
    """all_gather of ``inp`` into ``rows`` (p x n contiguous elements: a tensor, or a callable making it
    when the call's turn comes); ``deliver(rows)`` copies it to the caller's outputs when they are not it."""
    core, mpi, p = ex.core, ex.mpi, ex.size
    numel, esz = inp.numel(), inp.element_size()
    dcode = wire.dtype_code(inp.dtype)
    if deliver is None and type(rows) is torch.Tensor and _cpu(rows) and _cpu(inp):
        return core.all_gather(_K_ALL_GATHER, (inp, rows), outputs, mpi, None, inp.data_ptr(), rows.data_ptr(),
                               numel, esz, dcode, None, None)
    header, big = core.flags(numel * esz * p)

    def make() -> object:
        fused = header and inp.nbytes <= _PAYLOAD
        src = host(inp) if fused else stage_in(inp, mpi)
        dst = rows if type(rows) is torch.Tensor else rows()
        buf = host(dst, copy=False) if fused or not mpi.accepts(dst.device) else stage_in(dst, mpi, copy=False)

        def post() -> None:
            stage_out(buf, dst)
            if deliver is not None:
                deliver(dst)

        return core.all_gather(_K_ALL_GATHER, (src, buf, dst), outputs, mpi, post, src.data_ptr(), buf.data_ptr(),
                               numel, esz, dcode, header, big)

    return Deferred(make, header, big, outputs, mpi, f"all_gather({inp.dtype}, {numel} elements per rank)")


def reduce_scatter(ex: Executor, out: torch.Tensor, rows: Buffer, red: Reduction) -> object:
    """reduce_scatter of ``rows`` (p x n contiguous elements: a tensor, or a callable making it when the
    call's turn comes) into ``out`` (n elements)."""
    core, mpi, p = ex.core, ex.mpi, ex.size
    numel = out.numel()
    total = numel * red.esz * p
    if type(rows) is torch.Tensor and _cpu(rows) and _cpu(out):
        post = (lambda: out.div_(p)) if red.avg else None
        return core.reduce_scatter(_K_REDUCE_SCATTER, (rows, out), [out], mpi, post, rows.data_ptr(), out.data_ptr(),
                                   numel, red.core, None, None)
    header, big = core.flags(total)

    def make() -> object:
        src = host(rows if type(rows) is torch.Tensor else rows())
        dst = host(out, copy=False) if header and total <= _PAYLOAD else stage_in(out, mpi, copy=False)

        def post() -> None:
            if red.avg:
                dst.div_(p)
            stage_out(dst, out)

        return core.reduce_scatter(_K_REDUCE_SCATTER, (src, dst), [out], mpi, post, src.data_ptr(), dst.data_ptr(),
                                   numel, red.core, header, big)

    return Deferred(make, header, big, [out], mpi, f"reduce_scatter({red.dtype}, {numel} elements per rank)")


def all_to_all(ex: Executor, inp: torch.Tensor, out: torch.Tensor, sb: list[int], rb: list[int], outputs: list,
               deliver: Callable[[], None] | None = None) -> object:
    """all_to_all of byte counts ``sb`` (to each rank) and ``rb`` (from each rank); the byte matrix is always
    exchanged (it fixes the rounds and lets every rank check that sends match receives)."""
    core, mpi = ex.core, ex.mpi
    dcode = wire.dtype_code(inp.dtype)
    if inp.is_cpu and out.is_cpu and inp.is_contiguous() and out.is_contiguous():
        return core.all_to_all(_K_ALL_TO_ALL, (inp, out), outputs, mpi, deliver, inp.data_ptr(), out.data_ptr(),
                               dcode, sb, rb, None)
    big = core.flags(max(sum(sb), sum(rb)))[1]

    def make() -> object:
        src = host(inp)
        dst = out if _cpu(out) else torch.empty(out.numel(), dtype=out.dtype)

        def post() -> None:
            if deliver is not None:
                deliver()
            elif dst is not out and out.numel():
                out.copy_(dst.view(out.shape))

        return core.all_to_all(_K_ALL_TO_ALL, (src, dst), outputs, mpi, post, src.data_ptr(), dst.data_ptr(), dcode,
                               sb, rb, big)

    return Deferred(make, True, big, outputs, mpi, f"all_to_all({inp.dtype}, send bytes {sb}, recv bytes {rb})",
                    wire.COMPARE_CALL)


def barrier(ex: Executor, header: bool) -> object:
    """barrier: the header exchange when checked (itself a full synchronisation), else MPI's."""
    return ex.core.barrier(_K_BARRIER, None, [], ex.mpi, None, header)
