"""torchhpc.braid on XBraid (engine="xbraid") under mpiexec: residual histories and solutions against the
Python engine and pymgrit, error propagation from callbacks, and LayerParallel gradients against serial ones.

XBraid measures the residual on the way down a cycle, after the fine-grid relaxation: with F-relaxation on the
fine grid its history is the Python engine's (and pymgrit's) shifted by one iteration (see
torchhpc.braid.xbraid).  With a fixed number of cycles the solutions agree for every relaxation and cycle.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

# the pymgrit problems, their torch steps and pymgrit itself, as test_braid (same directory) loads them
from test_braid import Mgrit, dahlquist, heat, simple_setup_problem

from torchhpc.braid import LayerParallel, solve, xbraid
from torchhpc.runtime.errors import EngineUnavailableError, RemoteError

MPI_RANKS = (1, 2, 4)
MPI_TIMEOUT = 240

try:
    xbraid.load()
    MISSING = None
except EngineUnavailableError as exc:
    MISSING = str(exc)
needs_xbraid = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
RTOL = 1e-10  # round-off, relative to each entry ...
ATOL = 1e-14  # ... or to the first residual, for entries near convergence (measured: about 1e-16 of it)


def test_engine_loads_or_says_what_is_missing(comm: MPI.Comm) -> None:
    _, step, u0 = dahlquist()
    if MISSING is not None:
        with pytest.raises(EngineUnavailableError, match="make native-xbraid"):
            solve(step, u0, [0.0, 1.0, 2.0], comm, engine="xbraid")
        return
    table = Path(__file__).resolve().parents[2] / "utils" / "native_versions.tsv"
    row = next(ln.split("\t") for ln in table.read_text().splitlines() if ln.startswith("xbraid\t"))
    assert row[1] == xbraid.load().XBRAID_VERSION
    assert xbraid.location() is not None


def _shifted(xb: list[float], ref: list[float] | np.ndarray) -> None:
    """XBraid's history from its second entry equals ``ref`` (to round-off) as far as both go."""
    k = min(len(xb) - 1, len(ref))
    assert k >= 3, (xb, ref)
    np.testing.assert_allclose(np.asarray(xb[1:1 + k]), np.asarray(ref[:k]), rtol=RTOL, atol=ATOL * ref[0])


CASES = [  # levels, cfactor, relax per level (F on the fine grid), cycle
    (2, 4, ["F"], "V"), (3, 2, ["F", "FCF"], "V"), (4, 2, ["F", "FCF"], "F"),
]


@needs_xbraid
@pytest.mark.parametrize("problem", ["dahlquist", "heat"])
@pytest.mark.parametrize(("levels", "cfactor", "relax", "cycle"), CASES)
def test_residuals_equal_python_engine_and_pymgrit(comm: MPI.Comm, problem, levels, cfactor, relax, cycle) -> None:
    prob, step, u0 = dahlquist() if problem == "dahlquist" else heat()
    opts = dict(max_levels=levels, cfactor=cfactor, relax=relax, cycle=cycle, tol=1e-9, max_iter=20,
                min_coarse=1, nested_iteration=False)
    py = solve(step, u0, prob.t, comm, **opts)
    xb = solve(step, u0, prob.t, comm, engine="xbraid", **opts)
    assert xb.levels == py.levels == levels
    _shifted(xb.residuals, py.residuals)
    assert xb.converged and xb.iterations == py.iterations + 1  # XBraid sees convergence one cycle later
    if len(relax) == 1:  # pymgrit takes one relaxation for every level
        cf_iter = {"F": 0, "FCF": 1}[relax[0]]
        ref = Mgrit(simple_setup_problem(prob, levels, cfactor), cf_iter=cf_iter, cycle_type=cycle,
                    nested_iteration=False, tol=1e-9, max_iter=20, logging_lvl=30).solve()["conv"]
        _shifted(xb.residuals, ref)


@needs_xbraid
@pytest.mark.parametrize(("relax", "cycle", "skip"), [
    ("FCF", "V", False), ("FCF", "V", True), (["FCF", "F"], "F", False), (2, "V", False),
])
def test_solutions_equal_after_the_same_cycles(comm: MPI.Comm, relax, cycle, skip) -> None:
    """Any relaxation, F-cycles (XBraid's FMG) and skip: k cycles on XBraid give the Python engine's iterate."""
    prob, step, u0 = heat(nt=33)
    opts = dict(max_levels=4, cfactor=2, relax=relax, cycle=cycle, skip_downcycle=skip, tol=0.0, max_iter=3,
                nested_iteration=False)
    ser = solve(step, u0, prob.t, MPI.COMM_SELF, **opts)
    xb = solve(step, u0, prob.t, comm, engine="xbraid", **opts)
    assert xb.iterations == 3 and not xb.converged
    assert comm.allreduce(len(xb.index)) == len(prob.t)
    scale = max(float(u.abs().max()) for u in ser.u)
    for j, u in zip(xb.index, xb.u, strict=True):
        assert xb.t[xb.index.index(j)] == prob.t[j]
        assert float((u - ser.u[j]).abs().max()) <= 1e-13 * scale, j
    if skip:
        assert math.isnan(xb.residuals[0])  # XBraid measures nothing on a skipped descent


@needs_xbraid
def test_relative_tolerance_and_norms(comm: MPI.Comm) -> None:
    prob, step, u0 = dahlquist(nt=65)
    xb = solve(step, u0, prob.t, comm, engine="xbraid", max_levels=3, relax="F", tol=0.0, rtol=1e-6, max_iter=30)
    assert xb.converged and xb.residuals[-1] < 1e-6 * xb.residuals[0]
    for norm in (1, math.inf):
        py = solve(step, u0, prob.t, comm, max_levels=3, relax="F", tol=1e-9, norm=norm, nested_iteration=False)
        xn = solve(step, u0, prob.t, comm, engine="xbraid", max_levels=3, relax="F", tol=1e-9, norm=norm)
        _shifted(xn.residuals, py.residuals)


@needs_xbraid
def test_settings_xbraid_cannot_express_are_refused(comm: MPI.Comm) -> None:
    _, step, u0 = dahlquist()
    t = [0.1 * i for i in range(9)]
    with pytest.raises(ValueError, match="no nested iteration"):
        solve(step, u0, t, comm, engine="xbraid", nested_iteration=True)
    with pytest.raises(ValueError, match="one tolerance"):
        solve(step, u0, t, comm, engine="xbraid", tol=1e-8, rtol=1e-3)
    if comm.Get_size() > 1:
        with pytest.raises(ValueError, match="cannot be honoured"):
            solve(step, u0, t, comm, engine="xbraid", partition=[1] * (comm.Get_size() - 1) + [
                len(t) - comm.Get_size() + 1])
    with pytest.raises(ValueError, match="engine must be"):
        solve(step, u0, t, comm, engine="braid")


@needs_xbraid
def test_callback_error_reaches_every_rank(comm: MPI.Comm) -> None:
    """A step that raises on the last rank: that rank gets its own exception, every other rank names it."""
    _, step, u0 = dahlquist(nt=33)
    last = comm.Get_size() - 1

    def bad(u: torch.Tensor, t0: float, t1: float) -> torch.Tensor:
        if comm.Get_rank() == last and t1 > 4.0:
            raise ArithmeticError(f"step to t={t1} refused")
        return step(u, t0, t1)

    t = [5.0 * i / 32 for i in range(33)]
    if comm.Get_rank() == last:
        with pytest.raises(ArithmeticError, match="refused"):
            solve(bad, u0, t, comm, engine="xbraid", max_levels=3, max_iter=50)
    else:
        with pytest.raises(RemoteError, match=f"rank {last}.*ArithmeticError: step to t=.* refused") as info:
            solve(bad, u0, t, comm, engine="xbraid", max_levels=3, max_iter=50)
        assert info.value.rank == last
    # the engine is usable again afterwards
    ok = solve(step, u0, t, comm, engine="xbraid", max_levels=3, relax="F", tol=1e-9, max_iter=30)
    assert ok.converged


# ---------------------------------------------------------------------------- LayerParallel on XBraid
from torch import nn  # noqa: E402


class _Step(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _open() -> nn.Module:
    return nn.Linear(3, 4, dtype=torch.float64)


def _close() -> nn.Module:
    return nn.Linear(4, 2, dtype=torch.float64)


@needs_xbraid
@pytest.mark.parametrize("levels", [1, 3])
def test_layer_parallel_gradients_equal_serial(comm: MPI.Comm, levels: int) -> None:
    """Forward and adjoint backward on XBraid: output, input gradient and every parameter gradient equal the
    serial network's (and the Python engine's) once both solves have converged."""
    blocks, steps = [_open, _Step, _close], [1, 8, 1]  # 11 points: uneven over 2 and 4 ranks
    nets = {}
    for engine in ("python", "xbraid"):
        lp = LayerParallel(comm, blocks, steps, Tf=1.0, max_fwd_levels=levels, max_bwd_levels=levels,
                           max_iters=30, seed=3, engine=engine)
        lp.setCFactor(2)
        lp.setNumRelax("F")
        lp.setAbsTol(1e-13)
        nets[engine] = lp
    torch.manual_seed(0)
    x = torch.randn(5, 3, dtype=torch.float64)
    seq = nets["xbraid"].build_sequential_on_root()
    outs = {}
    for engine, lp in nets.items():
        xin = x.clone().requires_grad_(True)
        y = lp(xin)
        (y ** 2).sum().backward()
        outs[engine] = (y.detach(), xin.grad.clone(), [p.grad.clone() for p in lp.parameters()])
    y_x, gx_x, gp_x = outs["xbraid"]
    y_p, gx_p, gp_p = outs["python"]
    assert torch.allclose(y_x, y_p, atol=1e-11) and torch.allclose(gx_x, gx_p, atol=1e-11)
    # parameter gradients by global layer: gather them and compare with the serial network on rank 0
    mine = {nets["xbraid"].layer_start + i: [p.grad.clone() for p in m.parameters()]
            for i, m in enumerate(nets["xbraid"].layers)}
    parts = comm.gather(mine, root=0)
    if comm.Get_rank() == 0:
        xin = x.clone().requires_grad_(True)
        ys = seq(xin)
        (ys ** 2).sum().backward()
        assert torch.allclose(y_x, ys, atol=1e-11) and torch.allclose(gx_x, xin.grad, atol=1e-11)
        got = {k: g for part in parts for k, g in part.items()}
        for k, layer in enumerate(seq):
            for g, p in zip(got[k], layer.parameters(), strict=True):
                assert torch.allclose(g, p.grad, atol=1e-10), k
    if levels > 1:
        its, res = nets["xbraid"].getFwdStats()
        assert its >= 2 and res[-1] < 1e-13
        assert nets["xbraid"].getBwdStats()[0] >= 2
