"""The default engine: nonblocking mpi4py calls (MPI-3 ``I*`` collectives, ``Isend``/``Irecv``).

Everything is started nonblocking so that the process group can poll with a deadline (timeouts)
and keep several segments in flight.  Data-movement collectives travel as bytes; reductions use
the typed datatype and op from :mod:`.reduction`.  CUDA tensors are handed to MPI directly only
when the MPI library reports CUDA support (:func:`mpi_cuda_aware`); otherwise the group stages
them through pinned host memory before they get here.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
from collections.abc import Callable

import torch
from mpi4py import MPI

from ..mpi_info import cuda_aware_query
from .engine import CollectiveEngine, Mode, Request
from .reduction import RedOp, mpi_reduction

__all__ = ["MpiEngine", "MpiRequest", "ThreadRequest", "DONE", "mpi_cuda_aware"]


@functools.cache
def mpi_cuda_aware() -> bool:
    """True when the MPI library can take CUDA device pointers (see :func:`torchhpc.mpi_info.cuda_aware_query`;
    ``TORCHHPC_CUDA_AWARE_MPI=0/1`` overrides)."""
    return cuda_aware_query().supported is True


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last (rows may be strided)."""
    if t.numel() == 0:
        return 0
    esz = t.element_size()
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1) * esz


_fromaddress = MPI.buffer.fromaddress
_BLOCKING, _NONBLOCKING = Mode.BLOCKING, Mode.NONBLOCKING


_BYTE = MPI.BYTE


def _bytes(t: torch.Tensor) -> list:
    n = t.nbytes
    return [_fromaddress(t.data_ptr(), n), n, _BYTE]


def _blocks(t: torch.Tensor, parts: int) -> list:
    """Byte buffer spec for a rank-major buffer of ``parts`` equal blocks (mpi4py counts per block)."""
    n = t.nbytes
    return [_fromaddress(t.data_ptr(), n), n // parts, _BYTE]


def _typed(t: torch.Tensor, datatype: MPI.Datatype) -> list:
    return [_fromaddress(t.data_ptr(), t.nbytes), t.numel(), datatype]


def _rows(t: torch.Tensor) -> tuple[MPI.buffer, list[int], list[int]]:
    """Base buffer, per-row byte counts and byte displacements of a 2-D (row-strided) tensor."""
    esz = t.element_size()
    row_bytes = t.shape[1] * esz
    stride_bytes = t.stride(0) * esz if t.shape[1] > 0 else row_bytes
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError("accl internal: row segments must be contiguous along dim 1")
    base = MPI.buffer.fromaddress(t.data_ptr(), _span(t))
    return base, [row_bytes] * t.shape[0], [i * stride_bytes for i in range(t.shape[0])]


def _rows_contiguous(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.shape[1] == 0


class MpiRequest:
    """One or more MPI requests completed together."""

    __slots__ = ("_reqs", "_status", "_done", "_keep")

    def __init__(self, reqs: list[MPI.Request], keep: object = None, status: MPI.Status | None = None):
        self._reqs = reqs
        self._status = status
        self._done = False
        self._keep = keep  # buffers that must outlive the request

    def test(self) -> bool:
        if self._done:
            return True
        reqs = self._reqs
        if len(reqs) == 1:
            done = reqs[0].Test(self._status)
        else:
            done = MPI.Request.Testall(reqs)
        if done:
            self._done = True
            self._keep = None
        return done

    def source(self) -> int:
        return self._status.Get_source() if self._status is not None else -1

    def nbytes(self) -> int:
        return self._status.Get_count(MPI.BYTE) if self._status is not None else -1


class ThreadRequest:
    """A blocking MPI call running on the engine's worker thread."""

    __slots__ = ("_fut", "_keep")

    def __init__(self, fut: cf.Future, keep: object = None):
        self._fut = fut
        self._keep = keep

    def test(self) -> bool:
        if not self._fut.done():
            return False
        exc = self._fut.exception()
        if exc is not None:
            raise exc
        self._keep = None
        return True

    def block(self, timeout: float) -> None:
        """Sleep (GIL released) until done or ``timeout`` seconds passed."""
        cf.wait([self._fut], timeout=timeout)

    def source(self) -> int:
        return -1

    def nbytes(self) -> int:
        return -1


class Done:
    """An operation that already completed (a blocking call made in the calling thread)."""

    __slots__ = ()

    def test(self) -> bool:
        return True

    def source(self) -> int:
        return -1

    def nbytes(self) -> int:
        return -1


#: the one completed request
DONE = Done()


class MpiEngine(CollectiveEngine):
    """Collective engine over an MPI communicator (duplicated: its traffic never meets the user's)."""

    name = "mpi"

    def __init__(self, comm: MPI.Comm):
        self.coll = comm.Dup()
        self.p2p = (comm.Dup(), comm.Dup())  # header and payload channels
        self.rank = self.coll.Get_rank()
        self.size = self.coll.Get_size()
        self.cuda_aware = mpi_cuda_aware()
        # Large collectives run as MPI's blocking (tuned) algorithms on a worker thread (Mode.WORKER):
        # on Open MPI the nonblocking ones (libnbc) reach a fraction of the bandwidth.
        self._can_thread = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._pool: cf.ThreadPoolExecutor | None = None

    def _run(self, name: str, mode: Mode, *args, keep: object = None):
        """Carry out collective ``name`` (the blocking mpi4py method's name) as ``mode`` says."""
        if mode is _BLOCKING:
            getattr(self.coll, name)(*args)
            return DONE
        if mode is _NONBLOCKING:
            return MpiRequest([getattr(self.coll, "I" + name.lower())(*args)], keep=keep)
        blocking = getattr(self.coll, name)
        return self.in_worker(lambda: blocking(*args), keep)

    def in_worker(self, run: Callable[[], object], keep: object = None) -> Request:
        """Run blocking MPI calls (``run``) on the engine's worker thread and return a request to poll; in
        the calling thread where MPI is not thread-safe (no THREAD_MULTIPLE)."""
        if not self._can_thread:
            run()
            return DONE
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="accl-mpi")
        return ThreadRequest(self._pool.submit(run), keep)

    def supports(self, collective: str, dtype: torch.dtype | None = None, op: RedOp | None = None) -> bool:
        return True

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cpu" or (device.type == "cuda" and self.cuda_aware)

    def allreduce(self, buf: torch.Tensor, op: RedOp, mode: Mode = Mode.NONBLOCKING) -> Request:
        dt, mop = mpi_reduction(buf.dtype, op)
        return self._run("Allreduce", mode, MPI.IN_PLACE, _typed(buf, dt), mop)

    def broadcast(self, buf: torch.Tensor, root: int, mode: Mode = Mode.NONBLOCKING) -> Request:
        return self._run("Bcast", mode, _bytes(buf), root)

    def reduce(self, buf: torch.Tensor, op: RedOp, root: int, mode: Mode = Mode.NONBLOCKING) -> Request:
        dt, mop = mpi_reduction(buf.dtype, op)
        if self.rank == root:
            return self._run("Reduce", mode, MPI.IN_PLACE, _typed(buf, dt), mop, root)
        return self._run("Reduce", mode, _typed(buf, dt), None, mop, root)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, mode: Mode = Mode.NONBLOCKING) -> Request:
        if _rows_contiguous(recv):
            return self._run("Allgather", mode, _bytes(send), _blocks(recv, self.size))
        base, counts, displs = _rows(recv)
        return self._run("Allgatherv", mode, _bytes(send), [base, counts, displs, MPI.BYTE])

    # gather/scatter always use the v-variants: a non-root rank cannot know whether the root's rows are
    # strided, and root and non-roots must call the same MPI collective (Gather and Gatherv differ).
    def gather(self, send: torch.Tensor, recv: torch.Tensor | None, root: int,
               mode: Mode = Mode.NONBLOCKING) -> Request:
        if self.rank != root:
            return self._run("Gatherv", mode, _bytes(send), None, root)
        base, counts, displs = _rows(recv)
        return self._run("Gatherv", mode, _bytes(send), [base, counts, displs, MPI.BYTE], root)

    def scatter(self, send: torch.Tensor | None, recv: torch.Tensor, root: int,
                mode: Mode = Mode.NONBLOCKING) -> Request:
        if self.rank != root:
            return self._run("Scatterv", mode, None, _bytes(recv), root)
        base, counts, displs = _rows(send)
        return self._run("Scatterv", mode, [base, counts, displs, MPI.BYTE], _bytes(recv), root)

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor, op: RedOp,
                       mode: Mode = Mode.NONBLOCKING) -> Request:
        dt, mop = mpi_reduction(recv.dtype, op)
        sbuf = [MPI.buffer.fromaddress(send.data_ptr(), send.numel() * send.element_size()), recv.numel(), dt]
        return self._run("Reduce_scatter_block", mode, sbuf, _typed(recv, dt), mop, keep=send)

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, mode: Mode = Mode.NONBLOCKING) -> Request:
        if _rows_contiguous(send) and _rows_contiguous(recv):
            return self._run("Alltoall", mode, _blocks(send, self.size), _blocks(recv, self.size))
        sbase, scounts, sdispls = _rows(send)
        rbase, rcounts, rdispls = _rows(recv)
        return self._run("Alltoallv", mode, [sbase, scounts, sdispls, MPI.BYTE],
                         [rbase, rcounts, rdispls, MPI.BYTE])

    def alltoallv(self, send: torch.Tensor, scounts: list[int], sdispls: list[int],
                  recv: torch.Tensor, rcounts: list[int], rdispls: list[int],
                  mode: Mode = Mode.NONBLOCKING) -> Request:
        sbuf = MPI.buffer.fromaddress(send.data_ptr(), send.numel())
        rbuf = MPI.buffer.fromaddress(recv.data_ptr(), recv.numel())
        return self._run("Alltoallv", mode, [sbuf, scounts, sdispls, MPI.BYTE], [rbuf, rcounts, rdispls, MPI.BYTE])

    def send(self, buf: torch.Tensor, dst: int, tag: int, channel: int = 1) -> MpiRequest:
        return MpiRequest([self.p2p[channel].Isend(_bytes(buf), dst, tag)], keep=buf)

    def recv(self, buf: torch.Tensor, src: int, tag: int, channel: int = 1) -> MpiRequest:
        source = MPI.ANY_SOURCE if src < 0 else src
        return MpiRequest([self.p2p[channel].Irecv(_bytes(buf), source, tag)], keep=buf, status=MPI.Status())

    def barrier(self, mode: Mode = Mode.NONBLOCKING) -> Request:
        return self._run("Barrier", mode)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        for comm in (self.coll, *self.p2p):
            if comm != MPI.COMM_NULL:
                with contextlib.suppress(MPI.Exception):  # pending operations after an abort
                    comm.Free()
