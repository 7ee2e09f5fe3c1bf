"""Shared test problems for the braid tests: pymgrit's Dahlquist and 1-D heat problems as step functions."""

from __future__ import annotations

import numpy as np
import scipy.sparse.linalg as sla
import torch

if not hasattr(np, "in1d"):  # pymgrit 1.0.6 calls np.in1d, removed in NumPy 2.4; np.isin is its replacement
    np.in1d = np.isin

from pymgrit.core.mgrit import Mgrit  # noqa: E402
from pymgrit.core.simple_setup_problem import simple_setup_problem  # noqa: E402
from pymgrit.dahlquist.dahlquist import Dahlquist  # noqa: E402
from pymgrit.heat.heat_1d import Heat1D  # noqa: E402

from torchhpc.braid import solve  # noqa: E402


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
