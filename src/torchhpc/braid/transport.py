"""Every wait on peer ranks, with a deadline: tensor messages between time ranks and the collectives braid uses.

Point-to-point: each message is a fixed-size header (logical clock, dtype, shape) followed by
the raw bytes.  CPU tensors travel as NumPy views; CUDA tensors go straight to MPI when it is
CUDA-aware (``TORCHHPC_CUDA_AWARE_MPI=1`` or Open MPI reporting CUDA support) and are staged
through host memory otherwise.

Collectives (dup, allreduce, allgather, bcast, gather) are MPI's nonblocking ones, polled to
completion by :func:`wait_all`; a barrier is :func:`torchhpc.runtime.waiting.barrier` (with
:func:`timeout_message` for braid's wording).  No call here can hang on a lost peer: past its
deadline it raises :class:`PeerTimeoutError` naming the operation, the rank and the likely
cause.  The default deadline is :data:`DEFAULT_TIMEOUT` seconds, or ``TORCHHPC_BRAID_TIMEOUT``.

The logical clock counts step evaluations along the longest chain of dependencies: a receive
advances it to the sender's clock, so its value at the end of a solve is the critical path in
steps, independent of the machine.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from torchhpc.runtime import errors, settings
from torchhpc.runtime.mpi_info import cuda_aware_query
from torchhpc.runtime.waiting import wait_requests

__all__ = ["Channel", "PeerTimeoutError", "DEFAULT_TIMEOUT", "default_timeout", "agreement_timeout",
           "timeout_message",
           "cuda_aware_mpi", "wait_all", "dup", "allreduce", "allgather_int", "bcast_tensor",
           "bcast_object", "gather_object"]

DEFAULT_TIMEOUT = 300.0
"""Seconds any braid operation waits for peer ranks before raising :class:`PeerTimeoutError`."""

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128, torch.complex64,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_HDR = 12  # clock, dtype code, ndim, up to 9 dims

# Old home of torchhpc.runtime.errors.PeerTimeoutError (a wait on peer ranks passed its deadline), kept importable.
PeerTimeoutError = errors.PeerTimeoutError


def default_timeout() -> float:
    """``TORCHHPC_BRAID_TIMEOUT`` (seconds) when set, else :data:`DEFAULT_TIMEOUT`."""
    value = settings.get("TORCHHPC_BRAID_TIMEOUT")
    return DEFAULT_TIMEOUT if value is None else check_timeout(value)


def check_timeout(timeout: float | None) -> float:
    """``timeout`` validated (> 0 seconds); None means :func:`default_timeout`."""
    if timeout is None:
        return default_timeout()
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    return float(timeout)


def agreement_timeout(timeout: float | None) -> float:
    """Deadline for agreeing on errors at an entry point: ``timeout`` if valid, else the default
    (an invalid ``timeout`` is itself the error the ranks agree on)."""
    try:
        return check_timeout(timeout)
    except ValueError:
        pass
    try:
        return default_timeout()
    except ValueError:  # a bad TORCHHPC_BRAID_TIMEOUT is then the error the ranks agree on
        return DEFAULT_TIMEOUT


def cuda_aware_mpi() -> bool:
    """Whether MPI can read and write CUDA device buffers directly (:func:`torchhpc.runtime.mpi_info.cuda_aware_query`;
    ``TORCHHPC_CUDA_AWARE_MPI=0/1`` overrides)."""
    return cuda_aware_query().supported is True


def wait_all(requests: Sequence[MPI.Request], timeout: float, what: str, comm: MPI.Comm,
             keep: Any = None, cancel: bool = False) -> None:
    """Complete ``requests`` or raise :class:`PeerTimeoutError` after ``timeout`` s (one poll loop:
    :func:`torchhpc.runtime.waiting.wait_requests`).

    ``what`` names the operation for the error.  ``keep`` (the buffers) stays alive with the
    requests if they are given up; ``cancel`` cancels them first (point-to-point receives only:
    MPI forbids cancelling collectives).
    """
    wait_requests(requests, timeout, what, keep=keep, cancel=cancel,
                  message=lambda: timeout_message(what, comm, timeout))


def timeout_message(what: str, comm: MPI.Comm, timeout: float) -> str:
    """braid's text for a wait on peers that passed its deadline: the operation, the rank, the likely cause."""
    return (f"torchhpc.braid: {what} on rank {comm.Get_rank()} of {comm.Get_size()} (world rank "
            f"{MPI.COMM_WORLD.Get_rank()}) did not complete within {timeout:g} s. Likely cause: a peer "
            "rank died, is stuck, or did not make the same call (every rank must run the same braid "
            "operations in the same order). If the peers are only slow, raise timeout= or "
            "TORCHHPC_BRAID_TIMEOUT; otherwise abort the job, this communicator is no longer usable.")


# ---------------------------------------------------------------------------- collectives
def dup(comm: MPI.Comm, timeout: float, what: str = "communicator duplication (MPI_Comm_idup)") -> MPI.Comm:
    """A duplicate of ``comm`` (its own message space), made without an unbounded wait."""
    new, req = comm.Idup()
    wait_all([req], timeout, what, comm, keep=new)
    return new


_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def allreduce(comm: MPI.Comm, value: float | int | np.ndarray, op: str, timeout: float,
              what: str = "allreduce") -> Any:
    """``op`` ("sum", "max", "min") of a number or a NumPy array over ``comm``; same type back."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    scalar = not isinstance(value, np.ndarray)
    if scalar:
        send = np.array([value], dtype=np.int64 if isinstance(value, int | np.integer) else np.float64)
    else:
        send = np.ascontiguousarray(value)
    recv = np.empty_like(send)
    wait_all([comm.Iallreduce(send, recv, op=_OPS[op])], timeout, f"{what} (MPI_Iallreduce, {op})", comm,
             keep=(send, recv))
    return recv[0].item() if scalar else recv


def allgather_int(comm: MPI.Comm, value: int, timeout: float, what: str = "allgather") -> list[int]:
    """Every rank's ``value``, in rank order."""
    send = np.array([value], dtype=np.int64)
    recv = np.empty(comm.Get_size(), dtype=np.int64)
    wait_all([comm.Iallgather(send, recv)], timeout, f"{what} (MPI_Iallgather)", comm, keep=(send, recv))
    return [int(v) for v in recv]


def bcast_tensor(comm: MPI.Comm, tensor: torch.Tensor | None, root: int, shape: Sequence[int],
                 dtype: torch.dtype, device: torch.device | str, timeout: float,
                 what: str = "tensor broadcast") -> torch.Tensor:
    """``root``'s tensor (of the ``shape`` and ``dtype`` every rank knows) on every rank, on ``device``.

    CUDA tensors go to MPI directly when it is CUDA-aware and are staged through host memory otherwise.
    """
    device = torch.device(device)
    direct = device.type == "cuda" and cuda_aware_mpi()
    if comm.Get_rank() == root:
        if tensor is None or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            got = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
            raise ValueError(f"{what}: root tensor {got} differs from the expected {(tuple(shape), dtype)}")
        buf = tensor.detach().to(device if direct else "cpu").contiguous().clone()
    else:
        buf = torch.empty(tuple(shape), dtype=dtype, device=device if direct else "cpu")
    raw = buf.reshape(-1).view(torch.uint8)
    mpi_buf = raw if direct else raw.numpy()
    wait_all([comm.Ibcast(mpi_buf, root=root)], timeout, f"{what} (MPI_Ibcast from rank {root})", comm,
             keep=(buf, mpi_buf))
    return buf if direct else buf.to(device)


def bcast_object(comm: MPI.Comm, obj: Any, root: int, timeout: float, what: str = "object broadcast") -> Any:
    """``root``'s picklable ``obj`` on every rank (its size first, then its bytes)."""
    is_root = comm.Get_rank() == root
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if is_root else b""
    size = np.array([len(data)], dtype=np.int64)
    wait_all([comm.Ibcast(size, root=root)], timeout, f"{what} size (MPI_Ibcast from rank {root})", comm,
             keep=size)
    buf = np.frombuffer(data, dtype=np.uint8).copy() if is_root else np.empty(int(size[0]), dtype=np.uint8)
    wait_all([comm.Ibcast(buf, root=root)], timeout, f"{what} (MPI_Ibcast from rank {root})", comm, keep=buf)
    return obj if is_root else pickle.loads(buf.tobytes())


def gather_object(comm: MPI.Comm, obj: Any, root: int, timeout: float,
                  what: str = "object gather") -> list[Any] | None:
    """Every rank's picklable ``obj`` as a list on ``root`` (None elsewhere)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8).copy()
    mine = np.array([data.size], dtype=np.int64)
    sizes = np.empty(size if rank == root else 0, dtype=np.int64)
    wait_all([comm.Igather(mine, sizes, root=root)], timeout, f"{what} sizes (MPI_Igather to rank {root})",
             comm, keep=(mine, sizes))
    if rank == root:
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        recv = np.empty(int(sizes.sum()), dtype=np.uint8)
        spec = [recv, (sizes.tolist(), displs.tolist()), MPI.BYTE]
    else:
        recv, spec = None, None
    wait_all([comm.Igatherv(data, spec, root=root)], timeout, f"{what} (MPI_Igatherv to rank {root})", comm,
             keep=(data, recv))
    if rank != root:
        return None
    return [pickle.loads(recv[d:d + s].tobytes()) for d, s in zip(displs.tolist(), sizes.tolist(), strict=True)]


# ---------------------------------------------------------------------------- point to point
class Channel:
    """Tensor sends and receives on one communicator, with pending-send tracking and a step clock.

    Peers are named by *logical* rank: ``order[i]`` is the communicator rank of logical rank ``i``
    (identity by default).  A reversed ``order`` lets the adjoint solve run backwards over the
    ranks without a reordered communicator (which only a blocking MPI_Comm_split could make).
    """

    def __init__(self, comm: MPI.Comm, timeout: float | None = None, order: Sequence[int] | None = None) -> None:
        self.comm = comm
        size = comm.Get_size()
        self.order = list(range(size)) if order is None else [int(r) for r in order]
        if sorted(self.order) != list(range(size)):
            raise ValueError(f"order {self.order} is not a permutation of the {size} ranks")
        self.rank = self.order.index(comm.Get_rank())
        self.timeout = check_timeout(timeout)
        self.clock = 0
        self.cuda_aware = cuda_aware_mpi()
        self._pending: list[tuple[MPI.Request, object]] = []

    def tick(self, n: int = 1) -> None:
        """Count ``n`` step evaluations on this rank's critical path."""
        self.clock += n

    def send(self, tensor: torch.Tensor, dest: int, tag: int) -> None:
        """Start sending ``tensor`` to logical rank ``dest``; the buffers stay alive until :meth:`flush`."""
        t = tensor.detach().contiguous()
        if t.ndim > _HDR - 3:
            raise ValueError(f"tensors of rank {t.ndim} are not supported (at most {_HDR - 3})")
        hdr = np.zeros(_HDR, dtype=np.int64)
        hdr[0], hdr[1], hdr[2] = self.clock, _DTYPES.index(t.dtype), t.ndim
        hdr[3:3 + t.ndim] = t.shape
        raw = t.reshape(-1).view(torch.uint8)
        if raw.is_cuda and not self.cuda_aware:
            raw = raw.cpu()
        buf = raw.numpy() if not raw.is_cuda else raw
        peer = self.order[dest]
        r1 = self.comm.Isend(hdr, dest=peer, tag=tag)
        r2 = self.comm.Isend(buf, dest=peer, tag=tag)
        self._pending += [(r1, hdr), (r2, (raw, buf))]

    def recv(self, source: int, tag: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Receive one tensor from logical rank ``source`` onto ``device`` (with the channel's deadline)."""
        peer = self.order[source]
        what = f"receive from rank {peer} (tag {tag})"
        hdr = np.zeros(_HDR, dtype=np.int64)
        wait_all([self.comm.Irecv(hdr, source=peer, tag=tag)], self.timeout, what, self.comm, keep=hdr,
                 cancel=True)
        dtype, ndim = _DTYPES[int(hdr[1])], int(hdr[2])
        shape = tuple(int(s) for s in hdr[3:3 + ndim])
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        device = torch.device(device)
        direct = device.type == "cuda" and self.cuda_aware
        raw = torch.empty(nbytes, dtype=torch.uint8, device=device if direct else "cpu")
        buf = raw if direct else raw.numpy()
        wait_all([self.comm.Irecv(buf, source=peer, tag=tag)], self.timeout, what, self.comm, keep=(raw, buf),
                 cancel=True)
        self.clock = max(self.clock, int(hdr[0]))
        out = raw.view(dtype).reshape(shape)
        return out if direct else out.to(device)

    def flush(self) -> None:
        """Complete every pending send."""
        pending, self._pending = self._pending, []
        wait_all([r for r, _ in pending], self.timeout, f"{len(pending)} pending sends", self.comm,
                 keep=pending)

    def sync_clock(self) -> None:
        """Collective: every rank's clock becomes the maximum (a collective waits for everyone)."""
        self.clock = allreduce(self.comm, self.clock, "max", self.timeout, "critical-path clock")
