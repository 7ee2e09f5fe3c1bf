"""``engine="xbraid"``: MGRIT on XBraid's C library (the ``_torchhpc_xbraid`` pybind11 module, ``make native-xbraid``).

Torch tensors are the braid vectors; the extension calls back into :class:`Adaptor` for every vector operation
(step, init, sum, spatial norm, access, buffer pack/unpack).  Fine point ``j`` is XBraid time ``j`` (times
``0 .. n-1``), so the step function sees fine indices exactly as the Python engine's does.

What differs from the Python engine, by XBraid's design: XBraid measures the space-time residual on the way
*down* a cycle, after that cycle's first relaxation on the fine grid (``braid_GetRNorms``), where the Python
engine (like pymgrit) measures it after the cycle.  With F-relaxation on the fine grid the two are the same
numbers one iteration apart: ``xbraid.residuals[k + 1] == python.residuals[k]``; ``residuals[0]`` is the
residual of the initial guess (NaN with ``skip_downcycle``, which XBraid does not measure).  XBraid therefore
stops one cycle after the Python engine would.  XBraid's own communication has no deadline (its MPI waits are
blocking): a dead peer hangs it, unlike the Python engine; errors raised in callbacks do stop every rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch
from mpi4py import MPI

from ..runtime import native
from ..runtime.errors import EngineUnavailableError
from ..runtime.waiting import agree
from .grid import Hierarchy, even_split
from .options import MGRITOptions

__all__ = ["Adaptor", "load", "location", "block_counts", "check_options", "run"]

_HDR_BYTES = 8 * 12  # int64: valid flag, dtype code, ndim, up to 9 dims
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128, torch.complex64]


def load() -> ModuleType:
    """The ``_torchhpc_xbraid`` extension, or :class:`~torchhpc.runtime.errors.EngineUnavailableError` naming it and
    ``make native-xbraid`` (see :mod:`torchhpc.runtime.native`)."""
    return native.load("xbraid")


def location() -> str | None:
    """Path the extension loads from, or None when it is not built (for doctor and tests)."""
    try:
        return str(load().__file__)
    except EngineUnavailableError:
        return None


def block_counts(n: int, size: int) -> list[int]:
    """XBraid's block distribution of ``n`` points over ``size`` ranks (``_braid_GetBlockDistInterval``)."""
    return even_split(n, size)


def check_options(opts: MGRITOptions) -> tuple[float, bool]:
    """(tolerance, relative?) as XBraid takes them; ValueError for settings XBraid cannot express."""
    if opts.nested_iteration:
        raise ValueError("engine='xbraid': XBraid has no nested iteration (pymgrit's coarse-to-fine initial "
                         "guess); pass nested_iteration=False")
    if opts.tol > 0 and opts.rtol > 0:
        raise ValueError("engine='xbraid': XBraid stops on one tolerance, absolute (tol) or relative (rtol); "
                         f"got tol={opts.tol} and rtol={opts.rtol}: set the other one to 0")
    return (opts.rtol, True) if opts.rtol > 0 else (opts.tol, False)


class Adaptor:
    """The Python side of the braid vectors: every tensor operation XBraid asks for, on immutable tensors."""

    def __init__(self, phi: Callable[[torch.Tensor, int, int], torch.Tensor], u0: torch.Tensor,
                 init: Callable[[int], torch.Tensor], max_bytes: int) -> None:
        self.phi, self.u0, self.make = phi, u0, init
        self.device, self.bufsize = u0.device, _HDR_BYTES + max_bytes
        self.out: dict[int, torch.Tensor] = {}
        self.nsteps, self.t_step = 0, 0.0

    def step(self, u: torch.Tensor, tstart: float, tstop: float, level: int) -> torch.Tensor:
        self.nsteps += 1
        t0 = time.perf_counter()
        out = self.phi(u, round(tstart), round(tstop))
        self.t_step += time.perf_counter() - t0
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"step must return a torch.Tensor, got {type(out).__name__}")
        return out

    def init(self, t: float) -> torch.Tensor:
        j = round(t)
        return self.u0 if j == 0 else self.make(j)

    @staticmethod
    def sum(alpha: float, x: torch.Tensor, beta: float, y: torch.Tensor) -> torch.Tensor:
        """alpha x + beta y as a new tensor (exact for the +-1 and 0 factors XBraid uses)."""
        if beta == 0.0:
            return x * alpha if alpha != 1.0 else x
        if alpha == 0.0:
            return y * beta
        return torch.add(y if beta == 1.0 else y * beta, x, alpha=alpha)

    @staticmethod
    def norm(u: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(u.reshape(-1)))

    def access(self, t: float, u: torch.Tensor, level: int, done: int) -> None:
        if level == 0:
            self.out[round(t)] = u

    def pack(self, u: torch.Tensor, view: memoryview) -> int:
        t = u.detach().contiguous().cpu()
        if t.dtype not in _DTYPES or t.ndim > 9:
            raise TypeError(f"engine='xbraid' sends {t.dtype} tensors of rank {t.ndim}; supported are "
                            f"floating/complex dtypes of rank <= 9")
        nbytes = t.numel() * t.element_size()
        if _HDR_BYTES + nbytes > self.bufsize:
            raise ValueError(f"engine='xbraid': a state of shape {tuple(t.shape)} ({nbytes} bytes) does not fit the "
                             f"message size {self.bufsize - _HDR_BYTES} bytes set from the initial state's shape")
        buf = np.frombuffer(view, dtype=np.uint8)
        hdr = np.zeros(12, dtype=np.int64)
        hdr[0], hdr[1], hdr[2] = 1, _DTYPES.index(t.dtype), t.ndim
        hdr[3:3 + t.ndim] = t.shape
        buf[:_HDR_BYTES] = hdr.view(np.uint8)
        buf[_HDR_BYTES:_HDR_BYTES + nbytes] = t.reshape(-1).view(torch.uint8).numpy()
        return _HDR_BYTES + nbytes

    def unpack(self, view: memoryview) -> torch.Tensor:
        buf = np.frombuffer(view, dtype=np.uint8)
        hdr = buf[:_HDR_BYTES].view(np.int64)
        if hdr[0] != 1:  # a rank whose callback failed sends an empty message; XBraid stops after this cycle
            return torch.zeros_like(self.u0)
        dtype, ndim = _DTYPES[int(hdr[1])], int(hdr[2])
        shape = tuple(int(s) for s in hdr[3:3 + ndim])
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        raw = torch.from_numpy(buf[_HDR_BYTES:_HDR_BYTES + nbytes].copy())
        return raw.view(dtype).reshape(shape).to(self.device)


def run(phi: Callable[[torch.Tensor, int, int], torch.Tensor], u0: torch.Tensor, n: int, comm: MPI.Comm,
        opts: MGRITOptions, *, init: Callable[[int], torch.Tensor] | None = None, norm: float = 2,
        max_bytes: int | None = None, reverted: bool = False, timeout: float = 300.0) -> dict:
    """One XBraid solve over fine points ``0 .. n-1`` on ``comm`` (collective).

    Returns ``residuals`` (NaN where XBraid measured none), ``iterations``, ``levels``, ``converged``, this
    rank's points ``u`` by fine index, ``steps`` and ``t_step``.  ``reverted``: XBraid's reverted ranks (the
    last rank holds the first points), for adjoints.  A callback error on any rank raises on every rank.
    """
    ext = load()
    opts.validate()
    tol, relative = check_options(opts)
    tnorm = {1: 1, 2: 2, math.inf: 3}.get(norm)
    if tnorm is None:
        raise ValueError(f"norm must be 1, 2 or inf, got {norm}")
    if comm.Get_size() > n:
        raise ValueError(f"more ranks ({comm.Get_size()}) than time points ({n})")
    # the level count our hierarchy has; XBraid's min_coarse counts intervals, ours points
    levels = Hierarchy(n, [n], opts.cfactor, opts.max_levels, opts.min_coarse).nlevels
    make = init if init is not None else (lambda j: torch.zeros_like(u0))
    if max_bytes is None:
        max_bytes = u0.numel() * u0.element_size()
    ad = Adaptor(phi, u0, make, max_bytes)
    nl = max(levels, 1)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = ext.run(MPI._addressof(comm), ad, n - 1, nl, max(opts.min_coarse - 1, 0),
                      [int(c) for c in opts.cfactor], [int(r) for r in opts.relax],
                      [float(opts.weight_c)], float(tol), relative, int(opts.max_iter), bool(opts.skip_downcycle),
                      opts.cycle == "F", tnorm, reverted, ad.bufsize,
                      1 if opts.print_level >= 1 and comm.Get_rank() == 0 else 0)
    _agree_on_errors(comm, out["error"], timeout)
    res = [math.nan if r == ext.INVALID_RNORM else float(r) for r in out["residuals"]]
    valid = [r for r in res if not math.isnan(r)]
    thresh = tol * valid[0] if relative and valid else tol
    return dict(residuals=res, iterations=int(out["iterations"]), levels=int(out["levels"]),
                converged=bool(valid) and valid[-1] < thresh, u=dict(sorted(ad.out.items())), steps=ad.nsteps,
                t_step=ad.t_step, solve=time.perf_counter() - t0)


def _agree_on_errors(comm: MPI.Comm, error: BaseException | None, timeout: float) -> None:
    """Every rank raises when any rank's callback raised: that rank its own exception, the others
    :class:`~torchhpc.runtime.errors.RemoteError` naming it and its error."""
    agree(comm, error, timeout, "XBraid solve (torchhpc.braid engine='xbraid')")
    if error is not None:
        raise error
