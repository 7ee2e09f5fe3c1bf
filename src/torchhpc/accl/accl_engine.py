"""The ``accl`` engine: collectives on Xilinx ACCL (Alveo FPGA or its emulator) through ``pyaccl``.

``pyaccl`` is ACCL's Python driver. It left the ACCL repository in June 2022 and lives in Xilinx/pyaccl; it is not
on PyPI, needs ``pynq`` and ``pyzmq``, and has an emulator device for hosts without an Alveo card (an Alveo card
also needs XRT).  ACCL's C++ driver (``driver/xrt``) needs XRT headers even for the emulator, so this engine
stays on the Python driver.
The engine reaches the device one of two ways:

- emulator: ``TORCHHPC_ACCL_SIM_SOCK`` (or ``AcclOptions.accl_sim_sock``), a ZMQ address with
  ``{rank}``/``{port}`` placeholders, e.g. ``tcp://localhost:{port}`` (port = start port + rank);
- hardware: ``TORCHHPC_ACCL_XCLBIN``, the ACCL bitstream loaded with ``pynq.Overlay``.

What the driver does itself: SUM reductions and data movement for float16/32/64 and int32/64
(its default arithmetic configurations).  Everything else (other ops and dtypes, all-to-all,
barrier) falls back to MPI when listed in ``AcclOptions.sidestep`` (default: every collective).
The class is the C++ backend's ``Engine`` (``csrc/accl.hpp``), implemented in Python because ``pyaccl`` is
Python: the backend calls it with one segment's host tensors (a ``rows`` tensor is every rank's block of the
segment, rows possibly strided) and reduce ops by name, in the thread that runs the call (the caller's, or the
group's worker for queued work).  Driver calls block, one at a time per
process (one device), so the group timeout cannot interrupt one.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import torch
from mpi4py import MPI

from ..runtime.errors import EngineUnavailableError
from . import core
from .options import AcclOptions

__all__ = ["AcclEngine", "ACCL_DTYPES", "load_driver_module"]

ACCL_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
               torch.int32: np.int32, torch.int64: np.int64}
_driver_lock = threading.Lock()
_driver_state: dict = {}  # one driver (device) per process, shared by all groups that use it


def load_driver_module():
    """Import ``pyaccl.accl`` or say exactly what is missing."""
    try:
        from pyaccl import accl as driver_module
    except ImportError as exc:
        raise EngineUnavailableError(
            "accl engine: the 'pyaccl' package (ACCL's Python driver) is not installed "
            f"({exc}). Install Xilinx/pyaccl (with pynq and pyzmq) on a host with an Alveo card "
            "or the ACCL emulator, or use the default MPI engine (engine='mpi', "
            "TORCHHPC_ACCL_ENGINE=mpi).") from None
    return driver_module


def _host_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class AcclEngine(core.load_backend().Engine):  # type: ignore[misc]
    """The C++ backend's ``Engine`` over one ACCL communicator (the group's ranks on the process's ACCL device):
    blocking calls on host tensors, one segment each."""

    name = "accl"

    def __init__(self, comm: MPI.Comm, options: AcclOptions) -> None:
        super().__init__(self.name)
        mod = load_driver_module()
        self._mod = mod
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        world_ranks = comm.Get_group().Translate_ranks(list(range(self.size)), MPI.COMM_WORLD.Get_group())
        with _driver_lock:
            if "driver" not in _driver_state:
                _driver_state["driver"] = self._open_driver(mod, comm, options)
                _driver_state["ranks"] = world_ranks
            drv = _driver_state["driver"]
            base = _driver_state["ranks"]
            if world_ranks == base:
                self._comm_id = 0
            else:
                missing = [r for r in world_ranks if r not in base]
                if missing:
                    raise EngineUnavailableError(f"accl engine: ranks {missing} are not on the ACCL "
                                                 f"communicator opened first ({base})")
                drv.split_communicator([base.index(r) for r in world_ranks])
                self._comm_id = len(drv.communicators) - 1
        self._drv = drv
        self._sum = mod.ACCLReduceFunctions.SUM

    @staticmethod
    def _open_driver(mod, comm: MPI.Comm, options: AcclOptions):
        rank = comm.Get_rank()
        port = options.accl_start_port + rank
        me = {"ip": _host_ip(), "port": port, "session_id": rank, "max_segment_size": options.accl_bufsize}
        ranks = comm.allgather(me)
        try:
            if options.accl_sim_sock:
                sock = options.accl_sim_sock.format(rank=rank, port=port)
                return mod.accl(ranks, rank, protocol=options.accl_protocol, bufsize=options.accl_bufsize,
                                sim_sock=sock)
            if options.accl_xclbin:
                import pynq  # noqa: PLC0415 - only on Alveo hosts

                overlay = pynq.Overlay(options.accl_xclbin)
                return mod.accl(ranks, rank, protocol=options.accl_protocol, bufsize=options.accl_bufsize,
                                overlay=overlay, cclo_ip=overlay.ccl_offload_0,
                                hostctrl_ip=overlay.hostctrl_0)
        except EngineUnavailableError:
            raise
        except Exception as exc:
            raise EngineUnavailableError(f"accl engine: could not open the ACCL device on rank {rank}: "
                                         f"{type(exc).__name__}: {exc}") from exc
        raise EngineUnavailableError(
            "accl engine: no ACCL device given. Set TORCHHPC_ACCL_SIM_SOCK (emulator, e.g. "
            "'tcp://localhost:{port}') or TORCHHPC_ACCL_XCLBIN (Alveo bitstream), or use engine='mpi'.")

    # ------------------------------------------------------------------ capability
    def supports(self, collective: str, dtype: torch.dtype, op: str | None) -> bool:
        """Whether the driver does ``collective`` on ``dtype`` with reduce op ``op`` (None: a data move): its
        default arithmetic configurations, SUM only (else the call sidesteps to MPI).  The backend asks only for
        the collectives the engine interface has."""
        return dtype in ACCL_DTYPES and op in (None, "SUM")

    # ------------------------------------------------------------------ buffers
    def _buffer(self, n: int, dtype: torch.dtype):
        """A device buffer of ``n`` elements (emulator: SimBuffer; hardware: pynq.allocate)."""
        npdt = ACCL_DTYPES[dtype]
        drv = self._drv
        if getattr(drv, "sim_mode", False):
            return self._mod.SimBuffer(np.zeros((max(n, 1),), dtype=npdt), drv.cclo.socket)
        import pynq  # noqa: PLC0415

        return pynq.allocate((max(n, 1),), dtype=npdt, target=drv.cclo.devicemem)

    @staticmethod
    def _host(buf) -> np.ndarray:
        return buf if isinstance(buf, np.ndarray) else buf.data

    def _fill(self, buf, t: torch.Tensor) -> None:
        if t.numel():
            self._host(buf)[: t.numel()] = t.reshape(-1).numpy()

    def _drain(self, buf, t: torch.Tensor) -> None:
        if t.numel():
            t.copy_(torch.from_numpy(self._host(buf)[: t.numel()].copy()).view(t.shape))

    def _run(self, fn) -> None:
        """One driver call at a time per process: the device is shared by every group on it."""
        with _driver_lock:
            fn()

    # ------------------------------------------------------------------ collectives
    def allreduce(self, buf: torch.Tensor, op: str) -> None:
        def run() -> None:
            s, r = self._buffer(buf.numel(), buf.dtype), self._buffer(buf.numel(), buf.dtype)
            self._fill(s, buf)
            self._drv.allreduce(self._comm_id, s, r, buf.numel(), self._sum)
            self._drain(r, buf)
        self._run(run)

    def reduce(self, buf: torch.Tensor, op: str, root: int) -> None:
        def run() -> None:
            s, r = self._buffer(buf.numel(), buf.dtype), self._buffer(buf.numel(), buf.dtype)
            self._fill(s, buf)
            self._drv.reduce(self._comm_id, s, r, buf.numel(), root, self._sum)
            if self.rank == root:
                self._drain(r, buf)
        self._run(run)

    def broadcast(self, buf: torch.Tensor, root: int) -> None:
        def run() -> None:
            b = self._buffer(buf.numel(), buf.dtype)
            if self.rank == root:
                self._fill(b, buf)
            self._drv.bcast(self._comm_id, b, buf.numel(), root)
            if self.rank != root:
                self._drain(b, buf)
        self._run(run)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        def run() -> None:
            n = send.numel()
            s, r = self._buffer(n, send.dtype), self._buffer(n * self.size, send.dtype)
            self._fill(s, send)
            self._drv.allgather(self._comm_id, s, r, n)
            tmp = torch.from_numpy(self._host(r)[: n * self.size].copy()).view(self.size, n)
            recv.copy_(tmp.view(recv.shape))
        self._run(run)

    def gather(self, send: torch.Tensor, recv: torch.Tensor, root: int) -> None:
        def run() -> None:
            n = send.numel()
            s, r = self._buffer(n, send.dtype), self._buffer(n * self.size, send.dtype)
            self._fill(s, send)
            self._drv.gather(self._comm_id, s, r, n, root)
            if self.rank == root:
                recv.copy_(torch.from_numpy(self._host(r)[: n * self.size].copy()).view(recv.shape))
        self._run(run)

    def scatter(self, send: torch.Tensor, recv: torch.Tensor, root: int) -> None:
        def run() -> None:
            n = recv.numel()
            s, r = self._buffer(n * self.size, recv.dtype), self._buffer(n, recv.dtype)
            if self.rank == root:
                self._fill(s, send.contiguous())
            self._drv.scatter(self._comm_id, s, r, n, root)
            self._drain(r, recv)
        self._run(run)

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor, op: str) -> None:
        def run() -> None:
            n = recv.numel()
            s, r = self._buffer(n * self.size, recv.dtype), self._buffer(n, recv.dtype)
            self._fill(s, send)
            self._drv.reduce_scatter(self._comm_id, s, r, n, self._sum)
            self._drain(r, recv)
        self._run(run)

    def send(self, buf: torch.Tensor, dst: int, tag: int) -> None:
        def run() -> None:
            b = self._buffer(buf.numel(), buf.dtype)
            self._fill(b, buf)
            self._drv.send(self._comm_id, b, buf.numel(), dst, tag=tag)
        self._run(run)

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> None:
        def run() -> None:
            b = self._buffer(buf.numel(), buf.dtype)
            self._drv.recv(self._comm_id, b, buf.numel(), src, tag=tag)
            self._drain(b, buf)
        self._run(run)
