"""Synchronous fast paths of :class:`~.process_group.ProcessGroupACCL` and the header exchange they
share with the queued path.

A synchronous collective (``async_op=False``) of contiguous CPU tensors on an idle group (nothing
queued, nothing in flight) runs here, entirely in the caller's thread: no ``Op``, no closures, no
queue, and no ``Work`` object (torch's wrappers take ``None`` as "the backend synchronised the
call").  The wire protocol is the queued path's, call for call, so that a rank taking the fast path
matches a rank whose call was queued behind async work:

1. **Header**: one all-gather of a fixed-size slot on the control communicator (a persistent
   request where MPI has them, polled against the group timeout, so a missing peer never hangs
   the caller).  All-reduces up to ``_SMALL_BYTES`` carry their payload in it and are reduced
   locally with MPI's own ops in rank order (every rank computes the same bits).
2. **Data**: once the header proved that every rank is in this very call, MPI's blocking (tuned)
   collective runs directly on the tensors' memory, in segments of at most ``max_segment_bytes``
   per buffer, the same segments and MPI calls the queued path makes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
from mpi4py import MPI

from ..waiting import Backoff
from .common import (
    _DTYPE_CODE,
    _HDR_WORDS,
    _KIND,
    _MAGIC,
    _OP_CODE,
    _R,
    _SLOT_WORDS,
    _SMALL_BYTES,
    AcclMismatchError,
)
from .reduction import RedOp, check_reduction, mpi_reduction
from .work import AcclWork, Op

if TYPE_CHECKING:
    from .process_group import ProcessGroupACCL

__all__ = ["FastPathMixin", "FALLBACK", "HEADER", "MATRIX_MAX_RANKS"]

#: the nine leading header words: magic, kind, seq, dtype, op, root, bytes, numel, extra
HEADER = struct.Struct("=9q")
_PAYLOAD = _HDR_WORDS * 8  # byte offset of the payload in a slot
_SLOT = _SLOT_WORDS * 8
#: all_to_all carries its send/recv byte matrix row (2 x p int64) in the header slot up to this size
MATRIX_MAX_RANKS = _SMALL_BYTES // 16
FALLBACK = object()  # "not for the fast path": the caller takes the queued path

_K_AR, _K_BC, _K_AG, _K_RS, _K_A2A = (_KIND[k] for k in
                                      ("all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                       "all_to_all"))
_fromaddress = MPI.buffer.fromaddress


class _Reduction:
    """What a (dtype, op) all-reduce needs on the hot path, computed once per group and pair."""

    __slots__ = ("dcode", "ocode", "esz", "mpi_type", "mpi_op", "avg")

    def __init__(self, dtype: torch.dtype, op_t: RedOp):
        check_reduction(dtype, op_t, "all_reduce")  # raises a clear error for a bad pair
        self.dcode = _DTYPE_CODE[dtype]
        self.ocode = _OP_CODE[op_t]
        self.esz = dtype.itemsize
        self.mpi_type, self.mpi_op = mpi_reduction(dtype, _R.SUM if op_t == _R.AVG else op_t)
        self.avg = op_t == _R.AVG


class FastPathMixin:
    """Header exchange and synchronous fast paths (mixed into the process group)."""

    # ----------------------------------------------------------------- header buffers and request
    def _init_header(self: ProcessGroupACCL) -> None:
        p = self._size
        self._hdr_buf = bytearray(_SLOT)
        self._hdr_all_buf = bytearray(_SLOT * p)
        self._hdr_mb = MPI.buffer(self._hdr_buf)  # slice-assignable from another MPI.buffer
        self._hdr_all_mb = MPI.buffer(self._hdr_all_buf)
        self._peer_offsets = [r * _SLOT for r in range(p) if r != self._rank]
        self._hdr_specs = ([self._hdr_buf, _SLOT, MPI.BYTE], [self._hdr_all_buf, _SLOT, MPI.BYTE])
        try:  # MPI-4 persistent collective: cheapest to start; every header exchange must use it
            self._hdr_preq: MPI.Prequest | None = self._ctl.Allgather_init(*self._hdr_specs)
        except (NotImplementedError, MPI.Exception):
            self._hdr_preq = None
        self._reductions: dict[tuple[torch.dtype, int], _Reduction] = {}
        self._matrix_struct = struct.Struct(f"={2 * p}q")  # all_to_all's byte matrix row
        self._row_specs: dict[tuple[int, int], list] = {}

    def _hdr_start(self: ProcessGroupACCL) -> MPI.Request:
        """Start the header exchange of the slot in ``_hdr_buf`` (one at a time per group)."""
        req = self._hdr_preq
        if req is not None:
            req.Start()
            return req
        return self._ctl.Iallgather(*self._hdr_specs)

    def _hdr_agrees(self: ProcessGroupACCL, words: int = 8) -> bool:
        """Whether every rank's leading header ``words`` equal this rank's (cheap byte compare)."""
        if len(self._peer_offsets) > 8:  # many ranks: one vectorised compare
            h = self._hdr_all_np[:, :words]
            return bool((h == h[self._rank]).all())
        n = words * 8
        key = self._hdr_buf[:n]
        allb = self._hdr_all_buf
        for off in self._peer_offsets:  # noqa: SIM110 - a plain loop is the cheapest for few ranks
            if allb[off: off + n] != key:
                return False
        return True

    def _reduction(self: ProcessGroupACCL, dtype: torch.dtype, op_t: RedOp) -> _Reduction:
        """The cached hot-path facts of ``op_t`` on ``dtype`` (raises for an invalid pair)."""
        red = self._reductions.get((dtype, op_t.value))
        if red is None:
            red = self._reductions[(dtype, op_t.value)] = _Reduction(dtype, op_t)
        return red

    def _reduce_slots(self: ProcessGroupACCL, red: _Reduction, nbytes: int) -> None:
        """Reduce the ``nbytes`` payloads of all slots into rank 0's slot, in rank order, with MPI's op
        (the same op the large path uses, so results do not depend on the message size)."""
        specs = self._row_specs.get((red.dcode, nbytes))
        if specs is None:
            if len(self._row_specs) >= 256:  # bounded: one entry per (dtype, size) seen
                self._row_specs.clear()
            count = nbytes // red.esz
            addr = self._hdr_all_mb.address
            specs = [[_fromaddress(addr + r * _SLOT + _PAYLOAD, nbytes), count, red.mpi_type]
                     for r in range(self._size)]
            self._row_specs[(red.dcode, nbytes)] = specs
        acc = specs[0]
        mop = red.mpi_op
        for spec in specs[1:]:
            mop.Reduce_local(spec, acc)

    # ----------------------------------------------------------------- the shared synchronous steps
    def _idle(self: ProcessGroupACCL) -> bool:
        """Nothing queued or in flight and not aborted: a synchronous call may bypass the queue."""
        return not self._queue and not self._p2p and self._aborted is None

    def _exchange_now(self: ProcessGroupACCL, name: str, t: torch.Tensor, finished: list[Op],
                      words: int = 8) -> AcclWork | None:
        """Run the packed header's exchange and check it (caller holds the lock and packed the slot).
        Returns None when every rank agrees, else the failed call's Work (timeout: group aborted)."""
        try:
            req = self._hdr_start()
            if not req.Test():
                timed_out = self._poll_now(req.Test, name, t, finished)
                if timed_out is not None:
                    return AcclWork(self, timed_out)
        except BaseException as exc:  # noqa: BLE001 - MPI errors (a dead peer under ULFM) reach torch as Work
            return self._failed(name, t, exc)
        if not self._hdr_agrees(words):
            try:
                self._verify_rows(self._hdr_all, words=words)
            except AcclMismatchError as exc:
                return self._failed(name, t, exc)
        return None

    def _poll_now(self: ProcessGroupACCL, test: Callable[[], bool], name: str, t: torch.Tensor,
                  finished: list[Op]) -> Op | None:
        """Poll ``test`` until it is true or the group timeout passed (caller holds the lock), under the
        package's back-off (:class:`torchhpc.waiting.Backoff`).  On timeout abort the group and return
        the failed call's op."""
        pause = Backoff().pause
        deadline = 0.0
        while not test():
            t_now = pause()
            if not t_now:  # still spinning
                continue
            if self._p2p:  # receives in flight may need their payload posted to let peers reach us
                finished += self._progress_locked()
            if not deadline:
                deadline = t_now + self._timeout_s
            elif t_now > deadline:
                op = self._failed_op(name, t)
                self._abort_locked(op)
                finished += self._drain_locked()
                return op
        return None

    def _failed_op(self: ProcessGroupACCL, name: str, t: torch.Tensor) -> Op:
        """An op standing for the fast-path call just numbered, to carry its error to torch."""
        op = Op(name, [t], self._timeout_s)
        op.seq = self._seq - 1
        op.describe = f"{name}({t.dtype}, {t.numel()} elements) #{op.seq}"
        return op

    def _failed(self: ProcessGroupACCL, name: str, t: torch.Tensor, exc: BaseException) -> AcclWork:
        """The Work of a failed fast-path call: its ``wait()`` (torch calls it) raises ``exc``."""
        op = self._failed_op(name, t)
        self._fail(op, exc)  # a dead peer (ULFM) also aborts the group; the next poll drains the rest
        return AcclWork(self, op)

    def _note_call(self: ProcessGroupACCL, nbytes: int) -> None:
        """Account one data call of ``nbytes`` per buffer in ``stats`` (as ``_call`` does)."""
        st = self.stats
        st["engine_calls"] += 1
        if nbytes > st["max_call_bytes"]:
            st["max_call_bytes"] = nbytes

    def _settle_now(self: ProcessGroupACCL, finished: list[Op]) -> None:
        """Complete point-to-point ops that finished while polling (outside the lock)."""
        if finished:
            self._complete(finished)

    # ----------------------------------------------------------------- all_reduce
    def _allreduce_now(self: ProcessGroupACCL, t: torch.Tensor, op_t: RedOp) -> AcclWork | None | object:
        """Blocking all_reduce of one contiguous CPU tensor: header (carrying payloads up to
        ``_SMALL_BYTES``, reduced locally) or header + MPI's blocking all-reduce in segments.
        Unchecked groups skip the header for messages that fit one nonblocking call below
        ``threaded_min_bytes`` and poll that call itself instead (the queued path does the same)."""
        # keyed by the op's int value: hashing and comparing torch's enum objects costs ~0.5 us
        red = self._reductions.get((t.dtype, op_t.value)) or self._reduction(t.dtype, op_t)
        numel = t.numel()
        nbytes = numel * red.esz
        check = self.options.check
        fused = check and nbytes <= _SMALL_BYTES
        finished: list[Op] = []
        lock = self._lock
        lock.acquire()
        try:
            if self._queue or self._aborted is not None or (self._p2p and not fused):
                return FALLBACK
            seq = self._seq
            self._seq = seq + 1
            if not self._header_needed(self._mpi, nbytes):
                return self._allreduce_unchecked_now(t, op_t, nbytes, finished)
            HEADER.pack_into(self._hdr_buf, 0, _MAGIC, _K_AR, seq, red.dcode, red.ocode, 0, nbytes, numel, 0)
            if fused and nbytes:
                self._hdr_mb[_PAYLOAD: _PAYLOAD + nbytes] = _fromaddress(t.data_ptr(), nbytes)
            bad = self._exchange_now("all_reduce", t, finished)
            if bad is not None:
                return bad
            try:
                if fused:
                    if nbytes:
                        self._reduce_slots(red, nbytes)
                        _fromaddress(t.data_ptr(), nbytes)[:] = self._hdr_all_mb[_PAYLOAD: _PAYLOAD + nbytes]
                else:
                    self._blocking_allreduce(t, red)
                if red.avg:
                    t.div_(self._size)
            except BaseException as exc:  # noqa: BLE001 - reported through the Work
                return self._failed("all_reduce", t, exc)
            return None
        finally:
            lock.release()
            if finished:
                self._complete(finished)

    def _allreduce_unchecked_now(self: ProcessGroupACCL, t: torch.Tensor, op_t: RedOp, nbytes: int,
                                 finished: list[Op]) -> AcclWork | None:
        """Unchecked group, one nonblocking call (caller holds the lock): polled against the timeout."""
        if not nbytes:
            return None  # the queued path makes no data call either
        try:
            req = self._call(self._mpi, "allreduce", nbytes, t.view(-1), _R.SUM if op_t == _R.AVG else op_t)
            timed_out = self._poll_now(req.test, "all_reduce", t, finished)
            if timed_out is not None:
                return AcclWork(self, timed_out)
            if op_t == _R.AVG:
                t.div_(self._size)
        except BaseException as exc:  # noqa: BLE001
            return self._failed("all_reduce", t, exc)
        return None

    def _blocking_allreduce(self: ProcessGroupACCL, flat: torch.Tensor, red: _Reduction) -> None:
        """MPI's blocking all-reduce on contiguous ``flat`` in place, in segments of at most
        ``max_segment_bytes`` (the queued path's segments and calls)."""
        esz = red.esz
        numel = flat.numel()
        per = self._per(esz)
        dt, mop = red.mpi_type, red.mpi_op
        allreduce = self._mpi.coll.Allreduce
        base = flat.data_ptr()
        for a in range(0, numel, per):
            n = min(numel - a, per)
            self._note_call(n * esz)
            allreduce(MPI.IN_PLACE, [_fromaddress(base + a * esz, n * esz), n, dt], mop)

    # ----------------------------------------------------------------- broadcast / all_gather / reduce_scatter
    def _begin_now(self: ProcessGroupACCL, kind: int, dtype: torch.dtype, ocode: int, root: int,
                   nbytes: int, numel: int, total: int) -> int | None:
        """Claim a call number for a fast-path call (caller holds the lock) and pack its header;
        None when the call must be queued (group busy, or unchecked and too small for a header)."""
        if not self._idle() or not self._header_needed(self._mpi, total):
            return None
        seq = self._seq
        self._seq = seq + 1
        HEADER.pack_into(self._hdr_buf, 0, _MAGIC, kind, seq, _DTYPE_CODE.get(dtype, 99), ocode, root,
                         nbytes, numel, 0)
        return seq

    def _broadcast_now(self: ProcessGroupACCL, t: torch.Tensor, root: int) -> AcclWork | None | object:
        esz, numel = t.element_size(), t.numel()
        nbytes = numel * esz
        finished: list[Op] = []
        with self._lock:
            if self._begin_now(_K_BC, t.dtype, 0, root, nbytes, numel, nbytes) is None:
                return FALLBACK
            bad = self._exchange_now("broadcast", t, finished)
            if bad is None:
                try:
                    bcast = self._mpi.coll.Bcast
                    base = t.data_ptr()
                    per = self._per(esz)
                    for a in range(0, numel, per):
                        n = min(numel - a, per) * esz
                        self._note_call(n)
                        bcast([_fromaddress(base + a * esz, n), n, MPI.BYTE], root)
                except BaseException as exc:  # noqa: BLE001
                    bad = self._failed("broadcast", t, exc)
        self._settle_now(finished)
        return bad

    def _all_gather_now(self: ProcessGroupACCL, out: torch.Tensor, inp: torch.Tensor) -> AcclWork | None | object:
        p = self._size
        esz, numel = inp.element_size(), inp.numel()
        nbytes = numel * esz
        finished: list[Op] = []
        with self._lock:
            if self._begin_now(_K_AG, inp.dtype, 0, 0, nbytes, numel, nbytes * p) is None:
                return FALLBACK
            bad = self._exchange_now("all_gather", inp, finished)
            if bad is None:
                try:
                    coll = self._mpi.coll
                    src, dst = inp.data_ptr(), out.data_ptr()
                    per = self._per(esz, p)
                    if numel <= per or p == 1:  # one call: the queued path's contiguous-rows Allgather
                        for a in range(0, max(numel, 1), per):
                            n = min(numel - a, per) * esz
                            self._note_call(n * p)
                            coll.Allgather([_fromaddress(src + a * esz, n), n, MPI.BYTE],
                                           [_fromaddress(dst + a * esz, n * p), n, MPI.BYTE])
                    else:  # strided rows of the destination: Allgatherv, as the queued path
                        row = nbytes
                        span = (p - 1) * row
                        for a in range(0, numel, per):
                            n = min(numel - a, per) * esz
                            self._note_call(n * p)
                            coll.Allgatherv([_fromaddress(src + a * esz, n), n, MPI.BYTE],
                                            [_fromaddress(dst + a * esz, span + n), [n] * p,
                                             [r * row for r in range(p)], MPI.BYTE])
                except BaseException as exc:  # noqa: BLE001
                    bad = self._failed("all_gather", inp, exc)
        self._settle_now(finished)
        return bad

    def _reduce_scatter_now(self: ProcessGroupACCL, out: torch.Tensor, inp: torch.Tensor,
                            op_t: RedOp) -> AcclWork | None | object:
        p = self._size
        red = self._reduction_for(out.dtype, op_t, "reduce_scatter")
        esz, numel = red.esz, out.numel()
        nbytes = numel * esz
        finished: list[Op] = []
        with self._lock:
            if self._begin_now(_K_RS, out.dtype, red.ocode, 0, nbytes, numel, nbytes * p) is None:
                return FALLBACK
            bad = self._exchange_now("reduce_scatter", out, finished)
            if bad is None:
                try:
                    coll = self._mpi.coll
                    dt, mop = red.mpi_type, red.mpi_op
                    dst = out.data_ptr()
                    per = self._per(esz, p)
                    if not numel:
                        pass  # the queued path makes no data call either
                    elif numel <= per:
                        self._note_call(nbytes * p)
                        coll.Reduce_scatter_block([_fromaddress(inp.data_ptr(), nbytes * p), numel, dt],
                                                  [_fromaddress(dst, nbytes), numel, dt], mop)
                    else:  # segment rows: each call's send block is a contiguous copy, as queued,
                        rows = inp.view(p, numel)  # made in one reused buffer (no fresh pages per call)
                        scratch = self._scratch_bytes(per * esz * p)
                        for a in range(0, numel, per):
                            b = min(numel, a + per)
                            n = b - a
                            block = scratch[: n * esz * p].view(out.dtype).view(p, n)
                            block.copy_(rows[:, a:b])
                            self._note_call(n * esz * p)
                            coll.Reduce_scatter_block([_fromaddress(block.data_ptr(), n * esz * p), n, dt],
                                                      [_fromaddress(dst + a * esz, n * esz), n, dt], mop)
                    if red.avg:
                        out.div_(p)
                except BaseException as exc:  # noqa: BLE001
                    bad = self._failed("reduce_scatter", out, exc)
        self._settle_now(finished)
        return bad

    def _scratch_bytes(self: ProcessGroupACCL, nbytes: int) -> torch.Tensor:
        """A reusable byte buffer of at least ``nbytes`` (at most one segment), kept by the group."""
        buf = getattr(self, "_scratch", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return buf

    def _reduction_for(self: ProcessGroupACCL, dtype: torch.dtype, op_t: RedOp, what: str) -> _Reduction:
        red = self._reductions.get((dtype, op_t.value))
        if red is None:
            check_reduction(dtype, op_t, what)
            red = self._reduction(dtype, op_t)
        return red

    # ----------------------------------------------------------------- all_to_all
    def _pack_matrix(self: ProcessGroupACCL, sb: list[int], rb: list[int]) -> None:
        """This rank's send and receive byte counts into the slot's payload (int64 words)."""
        self._matrix_struct.pack_into(self._hdr_buf, _PAYLOAD, *sb, *rb)

    def _matrix_rounds(self: ProcessGroupACCL, kind: str, rows: list[list[int]] | None = None
                       ) -> tuple[int, bool]:
        """Check the all-gathered byte matrices (send of i to j == recv of j from i) and return the
        number of segment rounds and whether every rank sends the same to every rank (then one
        round is one MPI Alltoall); raises AcclMismatchError naming the first bad pair."""
        p = self._size
        if rows is None:
            rows = self._hdr_all_np[:, _HDR_WORDS: _HDR_WORDS + 2 * p].tolist()
        send = [row[:p] for row in rows]
        recv = [row[p:] for row in rows]
        bad = [(i, j) for i in range(p) for j in range(p) if send[i][j] != recv[j][i]]
        if bad:
            i, j = bad[0]
            raise AcclMismatchError(
                f"accl: {kind} split sizes do not match across ranks: rank {i} sends {send[i][j]} bytes "
                f"to rank {j}, which expects {recv[j][i]} bytes from it ({len(bad)} mismatched pairs)")
        rounds = max(1, math.ceil(max(max(r) for r in send) / max(1, self._seg // p)))
        return rounds, len({c for r in send for c in r}) == 1

    def _all_to_all_now(self: ProcessGroupACCL, out: torch.Tensor, inp: torch.Tensor, sb: list[int],
                        rb: list[int]) -> AcclWork | None | object:
        p = self._size
        if p > MATRIX_MAX_RANKS:
            return FALLBACK
        finished: list[Op] = []
        with self._lock:
            if not self._idle():
                return FALLBACK
            seq = self._seq
            self._seq = seq + 1
            HEADER.pack_into(self._hdr_buf, 0, _MAGIC, _K_A2A, seq, _DTYPE_CODE.get(inp.dtype, 99), 0, 0,
                             0, 0, p)
            self._matrix_struct.pack_into(self._hdr_buf, _PAYLOAD, *sb, *rb)
            bad = self._exchange_now("all_to_all", inp, finished, words=4)
            if bad is None:
                try:
                    mine = self._hdr_buf[_PAYLOAD: _PAYLOAD + 16 * p]
                    allb = self._hdr_all_buf
                    same = (sb == rb and len(set(sb)) == 1  # every rank sends and expects the same
                            and all(allb[o + _PAYLOAD: o + _PAYLOAD + 16 * p] == mine for o in self._peer_offsets))
                    if same:
                        rounds, uniform = max(1, math.ceil(sb[0] / max(1, self._seg // p))), True
                    else:
                        rounds, uniform = self._matrix_rounds("all_to_all")
                    src, dst = inp.data_ptr(), out.data_ptr()
                    if uniform and rounds == 1:  # the queued path's choice too
                        c = sb[0]
                        self._note_call(c * p)
                        self._mpi.coll.Alltoall([_fromaddress(src, c * p), c, MPI.BYTE],
                                                [_fromaddress(dst, c * p), c, MPI.BYTE])
                    else:
                        self._alltoallv_blocking(src, inp.numel() * inp.element_size(), sb,
                                                 dst, out.numel() * out.element_size(), rb, rounds)
                except BaseException as exc:  # noqa: BLE001
                    bad = self._failed("all_to_all", inp, exc)
        self._settle_now(finished)
        return bad

    def _alltoallv_blocking(self: ProcessGroupACCL, src: int, slen: int, sb: list[int], dst: int, rlen: int,
                            rb: list[int], rounds: int) -> None:
        """Blocking Alltoallv in ``rounds`` rounds of at most ``max_segment_bytes // p`` bytes per pair
        (the queued path's rounds)."""
        p = self._size
        per_pair = max(1, self._seg // p)
        sdis = list(accumulate(sb[:-1], initial=0))
        rdis = list(accumulate(rb[:-1], initial=0))
        sbuf = _fromaddress(src, slen)
        rbuf = _fromaddress(dst, rlen)
        a2a = self._mpi.coll.Alltoallv
        if rounds == 1 and max(sb) <= per_pair and max(rb) <= per_pair:  # the one round's counts
            self._note_call(max(sum(sb), sum(rb)))
            a2a([sbuf, sb, sdis, MPI.BYTE], [rbuf, rb, rdis, MPI.BYTE])
            return
        for k in range(rounds):
            lo = k * per_pair
            sc = [max(0, min(per_pair, s - lo)) for s in sb]
            rc = [max(0, min(per_pair, r - lo)) for r in rb]
            self._note_call(max(sum(sc), sum(rc)))
            a2a([sbuf, sc, [d + lo for d in sdis], MPI.BYTE], [rbuf, rc, [d + lo for d in rdis], MPI.BYTE])
