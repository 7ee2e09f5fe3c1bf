"""Time-parallel MGRIT (FAS) over MPI ranks for a user-supplied step function.

The problem enters only through ``step(u, t_start, t_stop)``; time points are
block-distributed over the ranks of ``comm`` and the iterates do not depend on the
number of ranks.  The cycle follows pymgrit's formulation (Falgout et al., SISC 2014):
F/FCF relaxation, injection, FAS coarse right-hand sides, a sequential coarsest solve,
and the space-time residual at fine C-points as the stopping test, so residual histories
can be compared with pymgrit point for point.  The coarsest solve runs as a pipeline
across ranks (XBraid style) instead of a gather on rank 0; it performs the same
operations in the same order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from mpi4py import MPI

from ..runtime.waiting import agreed
from . import xbraid
from .grid import Hierarchy, even_split
from .options import MGRITOptions
from .transport import Channel, agreement_timeout, allreduce, check_timeout, dup, timeout_message

__all__ = ["MGRIT", "MGRITResult", "solve"]

# message tags: one per phase and level, so a mismatch shows up as a timeout, never as wrong data
_F_TAIL, _F_EX, _C_EX, _RESTRICT, _COARSE = range(5)


def _tag(lvl: int, phase: int) -> int:
    return 8 * lvl + phase + 1


@dataclass
class MGRITResult:
    """What one rank holds after a solve.

    u, t, index: solution, time and global index of this rank's fine points.  residuals: the
    space-time residual norm after each iteration (same on every rank).  steps: step
    evaluations on this rank; critical_path: step evaluations on the longest dependency chain
    over all ranks (a machine-independent bound on parallel run time).
    """

    u: list[torch.Tensor]
    t: list[float]
    index: list[int]
    residuals: list[float]
    iterations: int
    converged: bool
    levels: int
    steps: int = 0
    critical_path: int = 0
    ghost: torch.Tensor | None = None
    timers: dict[str, float] = field(default_factory=dict)


class MGRIT:
    """One MGRIT solve over fine points ``0 .. n-1``; ``phi(u, i0, i1)`` propagates from fine index i0 to i1.

    ``counts[r]`` fine points go to logical rank ``r`` (default: pymgrit's even split), and
    ``order[r]`` is that rank's rank in ``comm`` (identity by default; reversed for an adjoint).
    ``init(j)`` gives the initial guess at fine point ``j`` (default zeros like ``u0``); ``u0``
    must be the same on every rank that reads it.  Every wait on peers ends after ``timeout``
    seconds with :class:`~torchhpc.braid.transport.PeerTimeoutError`.
    """

    def __init__(self, phi: Callable[[torch.Tensor, int, int], torch.Tensor], u0: torch.Tensor, n: int,
                 comm: MPI.Comm, opts: MGRITOptions, counts: Sequence[int] | None = None,
                 init: Callable[[int], torch.Tensor] | None = None, timeout: float | None = None,
                 norm: float = 2, order: Sequence[int] | None = None) -> None:
        opts.validate()
        self.ch = Channel(comm, timeout, order)
        self.comm, self.rank, self.size = comm, self.ch.rank, comm.Get_size()
        if counts is None:
            if self.size > n:
                raise ValueError(f"more ranks ({self.size}) than time points ({n})")
            counts = even_split(n, self.size)
        if len(counts) != self.size:
            raise ValueError(f"partition has {len(counts)} entries for {self.size} ranks")
        if norm not in (1, 2, math.inf):
            raise ValueError(f"norm must be 1, 2 or inf, got {norm}")
        self.phi_user, self.opts, self.norm = phi, opts, norm
        self.h = Hierarchy(n, counts, opts.cfactor, opts.max_levels, opts.min_coarse)
        self.L = self.h.nlevels
        self.lv = [self.h.level(lvl, self.rank) for lvl in range(self.L)]
        self.u: list[dict[int, torch.Tensor]] = [{} for _ in range(self.L)]
        self.v: list[dict[int, torch.Tensor]] = [{} for _ in range(self.L)]
        self.g: list[dict[int, torch.Tensor]] = [{} for _ in range(self.L)]
        self._phi_cache: dict[int, torch.Tensor] = {}
        self.nsteps = 0
        self.t_step = 0.0
        self.device = u0.device
        lev0 = self.lv[0]
        make = init if init is not None else (lambda j: torch.zeros_like(u0))
        first = lev0.lo - 1 if lev0.has_ghost else lev0.lo
        for j in range(first, lev0.hi):
            self.u[0][j] = u0 if j == 0 else make(j)
        for lvl in range(1, self.L):  # the initial condition is point 0 on every level
            if not self.lv[lvl].empty and self.lv[lvl].lo == 0:
                self.u[lvl][0] = u0

    # ------------------------------------------------------------------ helpers
    def _phi(self, u: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
        self.ch.tick()
        self.nsteps += 1
        t0 = time.perf_counter()
        out = self.phi_user(u, i0, i1)
        self.t_step += time.perf_counter() - t0
        return out

    def _step_into(self, lvl: int, j: int) -> torch.Tensor:
        """Phi from point j-1 to j on level lvl (fine level: from the cache when valid)."""
        if lvl == 0 and j in self._phi_cache:
            return self._phi_cache.pop(j)
        s = self.lv[lvl].stride
        return self._phi(self.u[lvl][j - 1], (j - 1) * s, j * s)

    def _send(self, lvl: int, j: int, dest: int, phase: int) -> None:
        self.ch.send(self.u[lvl][j], dest, _tag(lvl, phase))

    def _recv_ghost(self, lvl: int, phase: int) -> None:
        lev = self.lv[lvl]
        self.u[lvl][lev.lo - 1] = self.ch.recv(lev.prev_owner, _tag(lvl, phase), self.device)

    def _exchange(self, lvl: int, c_points: bool) -> None:
        """After updating the C- (or F-) points of a level: pass the last point on when the next
        rank's first point is of the other kind and needs it as its ghost."""
        lev = self.lv[lvl]
        if lev.empty:
            return
        m = lev.cfactor
        kind = (lambda j: j % m == 0) if c_points else (lambda j: j % m != 0)
        phase = _C_EX if c_points else _F_EX
        if lev.next_owner is not None and kind(lev.hi - 1) and not kind(lev.hi):
            self._send(lvl, lev.hi - 1, lev.next_owner, phase)
        if lev.has_ghost and kind(lev.lo - 1) and not kind(lev.lo):
            self._recv_ghost(lvl, phase)

    # ------------------------------------------------------------------ relaxation
    def _f_relax(self, lvl: int, exchange: bool = True) -> None:
        lev = self.lv[lvl]
        if lvl == 0:
            self._phi_cache.clear()
        if lev.empty:
            return
        m = lev.cfactor
        groups: list[list[int]] = []
        for j in range(lev.lo, lev.hi):
            if j % m == 0:
                continue
            if groups and groups[-1][-1] == j - 1:
                groups[-1].append(j)
            else:
                groups.append([j])
        head_recv = lev.has_ghost and lev.lo % m != 0 and (lev.lo - 1) % m != 0
        tail_send = lev.next_owner is not None and (lev.hi - 1) % m != 0 and lev.hi % m != 0
        g = self.g[lvl]
        # the interval continuing onto the next rank first, the one continuing from the previous last
        for k in range(len(groups) - 1, -1, -1):
            if k == 0 and head_recv:
                self._recv_ghost(lvl, _F_TAIL)
            for j in groups[k]:
                x = self._step_into(lvl, j)
                gj = g.get(j)
                self.u[lvl][j] = x if gj is None else gj + x
            if k == len(groups) - 1 and tail_send:
                self._send(lvl, lev.hi - 1, lev.next_owner, _F_TAIL)
        if exchange:
            self._exchange(lvl, c_points=False)

    def _c_relax(self, lvl: int) -> None:
        lev, w = self.lv[lvl], self.opts.weight_c
        g = self.g[lvl]
        for j in range(max(lev.lo, 1), lev.hi):
            if j % lev.cfactor:
                continue
            x = self._step_into(lvl, j)
            gj = g.get(j)
            if gj is not None:
                x = gj + x
            self.u[lvl][j] = x if w == 1.0 else x * w + self.u[lvl][j] * (1.0 - w)
        self._exchange(lvl, c_points=True)

    # ------------------------------------------------------------------ grid transfer
    def _restrict(self, lvl: int) -> None:
        """Inject C-points to level lvl+1 and form the FAS right-hand side there."""
        lev, c = self.lv[lvl], self.lv[lvl + 1]
        m = lev.cfactor
        if c.empty:
            return
        if c.next_owner is not None:
            self.ch.send(self.u[lvl][(c.hi - 1) * m], c.next_owner, _tag(lvl, _RESTRICT))
        v: dict[int, torch.Tensor] = {}
        if c.has_ghost:
            v[c.lo - 1] = self.ch.recv(c.prev_owner, _tag(lvl, _RESTRICT), self.device)
        for jc in range(c.lo, c.hi):
            v[jc] = self.u[lvl][jc * m]
        self.v[lvl + 1], self.u[lvl + 1] = v, dict(v)
        g_f, g_c, u_f, sc = self.g[lvl], {}, self.u[lvl], c.stride
        for jc in range(max(c.lo, 1), c.hi):
            j = jc * m
            fine = self._step_into(lvl, j)
            gj = g_f.get(j)
            r = fine - u_f[j] if gj is None else (gj - u_f[j]) + fine
            g_c[jc] = (r + v[jc]) - self._phi(v[jc - 1], (jc - 1) * sc, jc * sc)
        self.g[lvl + 1] = g_c

    def _correct(self, lvl: int) -> None:
        """Add the coarse-grid correction at the C-points of level lvl."""
        c, m = self.lv[lvl + 1], self.lv[lvl].cfactor
        for jc in range(max(c.lo, 1), c.hi):
            self.u[lvl][jc * m] = self.u[lvl][jc * m] + (self.u[lvl + 1][jc] - self.v[lvl + 1][jc])
        self._exchange(lvl, c_points=True)

    def _coarsest(self, lvl: int) -> None:
        """Sequential solve on the coarsest level, pipelined from rank to rank."""
        lev = self.lv[lvl]
        if lev.empty:
            return
        if lev.has_ghost:
            self._recv_ghost(lvl, _COARSE)
        g = self.g[lvl]
        for j in range(max(lev.lo, 1), lev.hi):
            x = self._step_into(lvl, j)
            gj = g.get(j)
            self.u[lvl][j] = x if gj is None else gj + x
        if lev.next_owner is not None:
            self._send(lvl, lev.hi - 1, lev.next_owner, _COARSE)

    # ------------------------------------------------------------------ cycles
    def _cycle(self, lvl: int, cycle: str, it: int, first_f: bool) -> None:
        if lvl == self.L - 1:
            self._coarsest(lvl)
            return
        if first_f and (lvl > 0 or it == 0):
            self._f_relax(lvl)
        for _ in range(self.opts.sweeps(lvl)):
            self._c_relax(lvl)
            self._f_relax(lvl)
        self._restrict(lvl)
        self._cycle(lvl + 1, cycle, it, True)
        self._up(lvl, cycle, it)

    def _up(self, lvl: int, cycle: str, it: int) -> None:
        """Coarse-grid correction and F-relaxation on level lvl (and, in an F-cycle, a V-cycle from there)."""
        self._correct(lvl)
        f_cycle = lvl > 0 and cycle == "F"
        self._f_relax(lvl, exchange=lvl == 0 or f_cycle)
        if f_cycle:
            self._cycle(lvl, "V", it, False)

    def _cycle_skipping_down(self, cycle: str) -> None:
        """The first cycle with XBraid's ``skip``: no work on the way down.

        The current C-point values are injected to every coarser level (as iterate and as the
        restricted value, with no FAS right-hand side, XBraid's ``_braid_CopyFineToCoarse``); the
        coarsest grid is solved and the up-cycle corrects and F-relaxes as in any cycle.  This saves
        the relaxation and restriction work of one descent when the initial guess carries no
        information worth smoothing (the common zero guess).
        """
        for lvl in range(self.L - 1):
            c, m = self.lv[lvl + 1], self.lv[lvl].cfactor
            v = {jc: self.u[lvl][jc * m] for jc in range(c.lo, c.hi)}
            self.v[lvl + 1], self.u[lvl + 1], self.g[lvl + 1] = v, dict(v), {}
        self._coarsest(self.L - 1)
        for lvl in range(self.L - 2, -1, -1):
            self._up(lvl, cycle, 0)

    def _nested(self) -> None:
        """FMG-style initial guess: solve the coarsest grid, then interpolate and V-cycle upwards."""
        self._coarsest(self.L - 1)
        for lvl in range(self.L - 2, -1, -1):
            c, m = self.lv[lvl + 1], self.lv[lvl].cfactor
            for jc in range(c.lo, c.hi):
                self.u[lvl][jc * m] = self.u[lvl + 1][jc]
            self._exchange(lvl, c_points=True)
            if lvl > 0:
                self._cycle(lvl, "V", 0, True)

    def _residual(self) -> float:
        """Space-time residual norm at the fine C-points (F-points are exact after F-relaxation)."""
        lev = self.lv[0]
        parts = []
        for j in range(max(lev.lo, 1), lev.hi):
            if j % lev.cfactor:
                continue
            phi = self._phi(self.u[0][j - 1], j - 1, j)
            self._phi_cache[j] = phi  # the next C-relaxation or restriction needs exactly this value
            parts.append(float(torch.linalg.vector_norm((phi - self.u[0][j]).reshape(-1))))
        self.ch.flush()
        tmo, what = self.ch.timeout, "MGRIT residual norm"
        if self.norm == math.inf:
            return allreduce(self.comm, max(parts, default=0.0), "max", tmo, what)
        if self.norm == 1:
            return allreduce(self.comm, float(sum(parts)), "sum", tmo, what)
        return math.sqrt(allreduce(self.comm, float(sum(p * p for p in parts)), "sum", tmo, what))

    def run(self) -> MGRITResult:
        """Iterate until the residual drops below the tolerance or ``max_iter`` is reached."""
        opts, t_start = self.opts, time.perf_counter()
        residuals: list[float] = []
        converged = False
        with torch.no_grad():
            if self.L == 1:
                # one level: the sequential solve is exact; its residual is zero by construction
                self._coarsest(0)
                self.ch.flush()
                residuals.append(0.0)
                converged = True
            else:
                if opts.nested_iteration:
                    self._nested()
                for it in range(opts.max_iter):
                    if it == 0 and opts.skip_downcycle:
                        self._cycle_skipping_down(opts.cycle)
                    else:
                        self._cycle(0, opts.cycle, it, True)
                    r = self._residual()
                    residuals.append(r)
                    if opts.print_level >= 1 and self.rank == 0:
                        print(f"  MGRIT iter {it + 1:3d}  residual {r:.6e}", flush=True)
                    if r < opts.tol or (opts.rtol > 0 and it > 0 and r < opts.rtol * residuals[0]):
                        converged = True
                        break
            self.ch.flush()
        self.ch.sync_clock()
        lev = self.lv[0]
        idx = list(range(lev.lo, lev.hi))
        return MGRITResult(
            u=[self.u[0][j] for j in idx], t=[], index=idx, residuals=residuals, iterations=len(residuals),
            converged=converged, levels=self.L, steps=self.nsteps, critical_path=self.ch.clock,
            ghost=self.u[0].get(lev.lo - 1) if lev.has_ghost else None,
            timers={"solve": time.perf_counter() - t_start, "step": self.t_step})


def solve(step: Callable[[torch.Tensor, float, float], torch.Tensor], u0: torch.Tensor,
          t: Sequence[float] | torch.Tensor, comm: MPI.Comm | None = None, *, max_levels: int = 10,
          cfactor: int | Sequence[int] = 2, cycle: str = "V", relax: str | int | Sequence[str | int] = "FCF",
          tol: float = 1e-7, rtol: float = 0.0, max_iter: int = 100, nested_iteration: bool | None = None,
          skip_downcycle: bool = False, weight_c: float = 1.0, min_coarse: int = 2, norm: float = 2,
          init: Callable[[int], torch.Tensor] | None = None, partition: Sequence[int] | None = None,
          timeout: float | None = None, print_level: int = 0, engine: str = "python") -> MGRITResult:
    """Solve ``u_i = step(u_{i-1}, t_{i-1}, t_i)``, ``u_0 = u0``, for all time points ``t`` at once.

    Collective over ``comm`` (default COMM_WORLD); every rank passes the same ``u0`` and ``t``.
    ``relax`` is "F", "FCF" or a number of CF sweeps, per level when a list (as is ``cfactor``).
    Returns this rank's share of the solution and the residual history.  No wait on other ranks
    lasts longer than ``timeout`` seconds (default :func:`~torchhpc.braid.transport.default_timeout`):
    past it, :class:`~torchhpc.braid.transport.PeerTimeoutError` names the operation and the rank.

    ``engine="xbraid"`` runs the same cycle on XBraid's C library (``make native``; see
    :mod:`torchhpc.braid.xbraid` for how its residual history lines up with this one).  ``nested_iteration``
    defaults to True here and to False on XBraid, which has none.
    """
    base = MPI.COMM_WORLD if comm is None else comm
    agree_s = agreement_timeout(timeout)
    with agreed(base, agree_s, "torchhpc.braid.mgrit.solve()", lambda: timeout_message(  # error on one rank: on all
            "MGRIT solve start (error agreement, MPI_Iallgather)", base, agree_s)):
        if engine not in ("python", "xbraid"):
            raise ValueError(f"engine must be 'python' or 'xbraid', got {engine!r}")
        if nested_iteration is None:
            nested_iteration = engine == "python"
        times = [float(x) for x in (t.tolist() if isinstance(t, torch.Tensor) else t)]
        if len(times) < 2:
            raise ValueError(f"need at least two time points, got {len(times)}")
        if any(b <= a for a, b in zip(times, times[1:], strict=False)):
            raise ValueError("time points must be strictly increasing")
        opts = MGRITOptions.build(max_levels=max_levels, cfactor=cfactor, relax=relax, cycle=cycle, tol=tol,
                                  rtol=rtol, max_iter=max_iter, nested_iteration=nested_iteration,
                                  skip_downcycle=skip_downcycle, weight_c=weight_c, min_coarse=min_coarse,
                                  print_level=print_level)
        timeout = check_timeout(timeout)
        if engine == "xbraid":  # extension present, settings XBraid can express, its own distribution
            xbraid.load()
            xbraid.check_options(opts)
            blocks = xbraid.block_counts(len(times), base.Get_size())
            if partition is not None and list(partition) != blocks:
                raise ValueError(f"engine='xbraid' distributes time points itself ({blocks} over "
                                 f"{base.Get_size()} ranks); partition={list(partition)} cannot be honoured")
    if engine == "xbraid":
        return _solve_xbraid(step, u0, times, base, opts, init, norm, timeout)
    work = dup(base, timeout, "MGRIT solve start (MPI_Comm_idup)")
    try:
        with agreed(work, timeout, "torchhpc.braid.mgrit.solve()"):
            solver = MGRIT(lambda u, i0, i1: step(u, times[i0], times[i1]), u0, len(times), work, opts,
                           counts=partition, init=init, timeout=timeout, norm=norm)
        res = solver.run()
    finally:
        work.Free()
    res.t = [times[j] for j in res.index]
    return res


def _solve_xbraid(step: Callable[[torch.Tensor, float, float], torch.Tensor], u0: torch.Tensor, times: list[float],
                  base: MPI.Comm, opts: MGRITOptions, init: Callable[[int], torch.Tensor] | None, norm: float,
                  timeout: float) -> MGRITResult:
    """:func:`solve` on XBraid (its block distribution of the time points), arguments already checked."""
    n = len(times)
    work = dup(base, timeout, "MGRIT solve start (MPI_Comm_idup)")
    try:
        out = xbraid.run(lambda u, i0, i1: step(u, times[i0], times[i1]), u0, n, work, opts, init=init, norm=norm,
                         timeout=timeout)
    finally:
        work.Free()
    idx = list(out["u"])
    return MGRITResult(u=list(out["u"].values()), t=[times[j] for j in idx], index=idx, residuals=out["residuals"],
                       iterations=out["iterations"], converged=out["converged"], levels=out["levels"],
                       steps=out["steps"], timers={"solve": out["solve"], "step": out["t_step"]})
