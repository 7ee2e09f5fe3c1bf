"""torchhpc.braid under mpiexec: MGRIT against pymgrit, and layer-parallel networks against serial ones."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg as sla
import torch
from mpi4py import MPI

if not hasattr(np, "in1d"):  # pymgrit 1.0.6 calls np.in1d, removed in NumPy 2.4; np.isin is its replacement
    np.in1d = np.isin

from pymgrit.core.mgrit import Mgrit  # noqa: E402
from pymgrit.core.simple_setup_problem import simple_setup_problem  # noqa: E402
from pymgrit.dahlquist.dahlquist import Dahlquist  # noqa: E402
from pymgrit.heat.heat_1d import Heat1D  # noqa: E402

from torchhpc.braid import solve  # noqa: E402

MPI_RANKS = (1, 2, 4)
MPI_TIMEOUT = 240


def dahlquist(nt: int = 65):
    """pymgrit's Dahlquist problem (lambda = -1, backward Euler) and the same step in torch."""
    prob = Dahlquist(t_start=0, t_stop=5, nt=nt, method="BE")

    def step(u: torch.Tensor, t0: float, t1: float) -> torch.Tensor:
        return u / (1 - (t1 - t0) * prob.lambda_value)

    return prob, step, torch.tensor(1.0, dtype=torch.float64)


def heat(nt: int = 33, nx: int = 17):
    """pymgrit's 1-D heat equation (backward Euler in time, central differences) and the same step."""
    prob = Heat1D(x_start=0, x_end=2 * np.pi, nx=nx, a=1.0, init_cond=np.sin,
                  rhs=lambda x, t: -np.sin(x) * (np.sin(t) - np.cos(t)), t_start=0, t_stop=2, nt=nt)

    def step(u: torch.Tensor, t0: float, t1: float) -> torch.Tensor:
        dt = t1 - t0
        v = sla.spsolve(dt * prob.space_disc + prob.identity, u.numpy() + prob.rhs(prob.x, t1) * dt)
        return torch.from_numpy(np.asarray(v))

    return prob, step, torch.from_numpy(prob.vector_t_start.get_values().copy())


def compare_with_pymgrit(problem, *, levels: int, cfactor: int, cf_iter: int, cycle: str, nested: bool,
                         tol: float = 1e-9, max_iter: int = 20, comm=None):
    """Run pymgrit and torchhpc.braid with the same settings; return both residual histories."""
    prob, step, u0 = problem
    hierarchy = simple_setup_problem(prob, levels, cfactor)
    ref = Mgrit(hierarchy, cf_iter=cf_iter, cycle_type=cycle, nested_iteration=nested, tol=tol,
                max_iter=max_iter, logging_lvl=30).solve()["conv"]
    ours = solve(step, u0, prob.t, comm, max_levels=levels, cfactor=cfactor, relax=cf_iter, cycle=cycle,
                 nested_iteration=nested, tol=tol, max_iter=max_iter, min_coarse=1)
    return np.asarray(ref), ours


def _assert_4_digits(ref: np.ndarray, ours: list[float]) -> None:
    # pymgrit's history omits iterations whose residual is exactly zero (it filters conv != 0)
    ours = [r for r in ours if r != 0.0]
    assert len(ours) == len(ref), (ref, ours)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=5e-5, atol=0)


@pytest.mark.parametrize(("levels", "cfactor", "cf_iter", "cycle", "nested"), [
    (2, 4, 1, "V", True), (3, 2, 0, "V", False), (3, 2, 1, "F", True), (4, 2, 2, "F", False),
    (4, 2, 1, "V", False),
])
def test_dahlquist_residuals_match_pymgrit(levels, cfactor, cf_iter, cycle, nested) -> None:
    ref, ours = compare_with_pymgrit(dahlquist(), levels=levels, cfactor=cfactor, cf_iter=cf_iter,
                                     cycle=cycle, nested=nested)
    _assert_4_digits(ref, ours.residuals)


@pytest.mark.parametrize(("levels", "cfactor", "cf_iter", "cycle", "nested"), [
    (2, 2, 1, "V", True), (3, 2, 0, "F", False), (3, 4, 1, "V", False),
])
def test_heat_residuals_match_pymgrit(levels, cfactor, cf_iter, cycle, nested) -> None:
    ref, ours = compare_with_pymgrit(heat(), levels=levels, cfactor=cfactor, cf_iter=cf_iter, cycle=cycle,
                                     nested=nested)
    _assert_4_digits(ref, ours.residuals)


def test_solution_independent_of_rank_count(comm: MPI.Comm) -> None:
    prob, step, u0 = heat(nt=29)
    opts = dict(max_levels=3, cfactor=2, relax="FCF", tol=1e-12, max_iter=30)
    par = solve(step, u0, prob.t, comm, **opts)
    ser = solve(step, u0, prob.t, MPI.COMM_SELF, **opts)
    assert par.residuals == pytest.approx(ser.residuals, rel=1e-10)
    for j, u in zip(par.index, par.u, strict=True):
        torch.testing.assert_close(u, ser.u[j], rtol=1e-13, atol=1e-15)
    assert comm.allreduce(len(par.index)) == len(prob.t)
    # the serial answer (time stepping) is reached
    x = u0
    exact = [x]
    for a, b in zip(prob.t[:-1], prob.t[1:], strict=True):
        x = step(x, a, b)
        exact.append(x)
    for j, u in zip(par.index, par.u, strict=True):
        torch.testing.assert_close(u, exact[j], rtol=1e-9, atol=1e-10)


def test_one_level_is_sequential_and_exact(comm: MPI.Comm) -> None:
    prob, step, u0 = dahlquist(nt=17)
    res = solve(step, u0, prob.t, comm, max_levels=1)
    assert res.iterations == 1 and res.levels == 1 and res.converged
    for j, u in zip(res.index, res.u, strict=True):
        assert float(u) == pytest.approx((1 / (1 + 5 / 16)) ** j, rel=1e-14)
    # the critical path of a sequential solve is every step
    assert res.critical_path == len(prob.t) - 1
