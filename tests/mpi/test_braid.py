"""torchhpc.braid under mpiexec: MGRIT against pymgrit, and layer-parallel networks against serial ones."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from braid_problems import compare_with_pymgrit, dahlquist, heat  # noqa: E402

from torchhpc.braid import solve  # noqa: E402

MPI_RANKS = (1, 2, 4)
MPI_TIMEOUT = 240


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
