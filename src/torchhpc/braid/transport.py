"""Point-to-point tensor messages between time ranks, with a deadline and a step clock.

Every message is a fixed-size header (logical clock, dtype, shape) followed by the raw
bytes.  CPU tensors travel as NumPy views; CUDA tensors go straight to MPI when it is
CUDA-aware (``TORCHHPC_CUDA_AWARE_MPI=1`` or Open MPI reporting CUDA support) and are
staged through host memory otherwise.  Waits poll with back-off and raise
:class:`TimeoutError` at the deadline instead of hanging on a lost peer.

The logical clock counts step evaluations along the longest chain of dependencies:
a receive advances it to the sender's clock, so its value at the end of a solve is
the critical path in steps, independent of the machine.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from mpi4py import MPI

__all__ = ["Channel", "cuda_aware_mpi"]

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128, torch.complex64,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_HDR = 12  # clock, dtype code, ndim, up to 9 dims


def cuda_aware_mpi() -> bool:
    """Whether MPI can read and write CUDA device buffers directly.

    ``TORCHHPC_CUDA_AWARE_MPI=0/1`` decides; otherwise Cray MPICH's ``MPICH_GPU_SUPPORT_ENABLED=1``
    or Open MPI's ``MPIX_Query_cuda_support()`` (looked up in the loaded MPI library) say yes.
    """
    env = os.environ.get("TORCHHPC_CUDA_AWARE_MPI")
    if env is not None:
        return env not in ("0", "", "false", "no")
    if os.environ.get("MPICH_GPU_SUPPORT_ENABLED") == "1":
        return True
    try:
        import ctypes

        query = ctypes.CDLL(None).MPIX_Query_cuda_support  # present in CUDA-capable Open MPI builds
        query.restype = ctypes.c_int
        return bool(query())
    except (AttributeError, OSError):
        return False


def wait_all(requests: list[MPI.Request], timeout: float, what: str) -> None:
    """Complete ``requests``, polling with back-off; raise TimeoutError after ``timeout`` seconds."""
    if not requests:
        return
    deadline = time.monotonic() + timeout
    spins, pause = 0, 1e-5
    while not MPI.Request.Testall(requests):
        spins += 1
        if spins > 200:
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        if time.monotonic() > deadline:
            for req in requests:  # best effort: do not leave a receive posted into a buffer we drop
                if req != MPI.REQUEST_NULL:
                    req.Cancel()
            raise TimeoutError(f"rank {MPI.COMM_WORLD.Get_rank()}: {what} not complete after {timeout:.0f} s "
                               "(a peer rank died or diverged?)")


class Channel:
    """Tensor sends and receives on one communicator, with pending-send tracking and a step clock."""

    def __init__(self, comm: MPI.Comm, timeout: float = 600.0) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.timeout = timeout
        self.clock = 0
        self.cuda_aware = cuda_aware_mpi()
        self._pending: list[tuple[MPI.Request, object]] = []

    def tick(self, n: int = 1) -> None:
        """Count ``n`` step evaluations on this rank's critical path."""
        self.clock += n

    def send(self, tensor: torch.Tensor, dest: int, tag: int) -> None:
        """Start sending ``tensor`` to ``dest``; the buffers stay alive until :meth:`flush`."""
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
        r1 = self.comm.Isend(hdr, dest=dest, tag=tag)
        r2 = self.comm.Isend(buf, dest=dest, tag=tag)
        self._pending += [(r1, hdr), (r2, (raw, buf))]

    def recv(self, source: int, tag: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Receive one tensor from ``source`` onto ``device`` (blocking, with the channel's deadline)."""
        hdr = np.zeros(_HDR, dtype=np.int64)
        wait_all([self.comm.Irecv(hdr, source=source, tag=tag)], self.timeout,
                 f"receive from rank {source} (tag {tag})")
        dtype, ndim = _DTYPES[int(hdr[1])], int(hdr[2])
        shape = tuple(int(s) for s in hdr[3:3 + ndim])
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        device = torch.device(device)
        direct = device.type == "cuda" and self.cuda_aware
        raw = torch.empty(nbytes, dtype=torch.uint8, device=device if direct else "cpu")
        wait_all([self.comm.Irecv(raw if direct else raw.numpy(), source=source, tag=tag)], self.timeout,
                 f"receive from rank {source} (tag {tag})")
        self.clock = max(self.clock, int(hdr[0]))
        out = raw.view(dtype).reshape(shape)
        return out if direct else out.to(device)

    def flush(self) -> None:
        """Complete every pending send."""
        wait_all([r for r, _ in self._pending], self.timeout, "send")
        self._pending.clear()

    def sync_clock(self) -> None:
        """Collective: every rank's clock becomes the maximum (a collective waits for everyone)."""
        self.clock = self.comm.allreduce(self.clock, op=MPI.MAX)
