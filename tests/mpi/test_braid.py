"""torchhpc.braid under mpiexec: MGRIT against pymgrit, and layer-parallel networks against serial ones."""

from __future__ import annotations

import importlib.util
import sys
import time
import types

import numpy as np
import pytest
import scipy.sparse.linalg as sla
import torch
from mpi4py import MPI

if not hasattr(np, "in1d"):  # pymgrit 1.0.6 calls np.in1d, removed in NumPy 2.4; np.isin is its replacement
    np.in1d = np.isin
if "pymgrit" not in sys.modules:
    # pymgrit's package __init__ imports every example problem (matplotlib, scipy.integrate, ...), about a
    # second per rank; an empty package object lets the four modules used here load on their own.
    _pkg = types.ModuleType("pymgrit")
    _pkg.__path__ = list(importlib.util.find_spec("pymgrit").submodule_search_locations)
    sys.modules["pymgrit"] = _pkg

from pymgrit.core.mgrit import Mgrit  # noqa: E402
from pymgrit.core.simple_setup_problem import simple_setup_problem  # noqa: E402
from pymgrit.dahlquist.dahlquist import Dahlquist  # noqa: E402
from pymgrit.heat.heat_1d import Heat1D  # noqa: E402

from torchhpc.braid import solve  # noqa: E402

MPI_RANKS = (1, 2, 4)
MPI_TIMEOUT = 240


def dahlquist(nt: int = 33):
    """pymgrit's Dahlquist problem (lambda = -1, backward Euler) and the same step in torch."""
    prob = Dahlquist(t_start=0, t_stop=5, nt=nt, method="BE")

    def step(u: torch.Tensor, t0: float, t1: float) -> torch.Tensor:
        return u / (1 - (t1 - t0) * prob.lambda_value)

    return prob, step, torch.tensor(1.0, dtype=torch.float64)


def heat(nt: int = 17, nx: int = 9):
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
    prob, step, u0 = heat(nt=15)
    opts = dict(max_levels=3, cfactor=2, relax="FCF", tol=1e-12, max_iter=30)
    par = solve(step, u0, prob.t, comm, **opts)
    ser = solve(step, u0, prob.t, MPI.COMM_SELF, **opts)
    assert par.residuals == pytest.approx(ser.residuals, rel=1e-10)
    for j, u in zip(par.index, par.u, strict=True):
        assert float((u - ser.u[j]).abs().max()) <= 1e-13 * float(ser.u[j].abs().max()) + 1e-15
    assert comm.allreduce(len(par.index)) == len(prob.t)
    if comm.Get_size() > 1:  # a skewed partition: rank 0 holds only the initial point
        from torchhpc.braid.grid import even_split

        counts = [1, *even_split(len(prob.t) - 1, comm.Get_size() - 1)]
        skew = solve(step, u0, prob.t, comm, partition=counts, **opts)
        assert skew.residuals == pytest.approx(ser.residuals, rel=1e-10)
        for j, u in zip(skew.index, skew.u, strict=True):
            assert float((u - ser.u[j]).abs().max()) <= 1e-13 * float(ser.u[j].abs().max()) + 1e-15
    # the serial answer (time stepping) is reached
    x = u0
    exact = [x]
    for a, b in zip(prob.t[:-1], prob.t[1:], strict=True):
        x = step(x, a, b)
        exact.append(x)
    for j, u in zip(par.index, par.u, strict=True):
        assert float((u - exact[j]).abs().max()) <= 1e-9


@pytest.mark.parametrize("cycle", ["V", "F"])
def test_skip_downcycle_is_xbraids_skip(comm: MPI.Comm, cycle: str) -> None:
    """XBraid's skip: the first cycle starts with the coarsest solve of the plain coarse problem (no
    relaxation, no FAS right-hand side), then corrects and F-relaxes upwards.  From a zero guess
    one such V-cycle gives a closed form on Dahlquist: coarse backward-Euler steps of m^2 dt, then
    steps of m dt and dt from each C-point."""
    nt, m, dt = 17, 2, 5 / 16
    prob, step, u0 = dahlquist(nt=nt)
    opts = dict(max_levels=3, cfactor=m, relax="FCF", nested_iteration=False, max_iter=1, cycle=cycle)
    skip = solve(step, u0, prob.t, comm, skip_downcycle=True, **opts)
    plain = solve(step, u0, prob.t, comm, **opts)
    if cycle == "V":
        for j, u in zip(skip.index, skip.u, strict=True):
            c2, r2 = divmod(j, m * m)  # last level-2 point, then level-1 steps and fine steps
            c1, r1 = divmod(r2, m)
            ref = (1 + m * m * dt) ** -c2 * (1 + m * dt) ** -c1 * (1 + dt) ** -r1
            assert float(u) == pytest.approx(ref, rel=1e-13), (j, float(u), ref)
    # the descent's relaxation and restriction are skipped: fewer steps, same converged answer
    assert comm.allreduce(skip.steps) < comm.allreduce(plain.steps)
    conv = solve(step, u0, prob.t, comm, skip_downcycle=True, **{**opts, "max_iter": 30, "tol": 1e-12})
    assert conv.converged
    for j, u in zip(conv.index, conv.u, strict=True):
        assert float(u) == pytest.approx((1 + dt) ** -j, rel=1e-10)


def test_solve_rejects_more_ranks_than_points(comm: MPI.Comm) -> None:
    if comm.Get_size() < 3:
        pytest.skip("not at this rank count: needs more ranks than the smallest time grid (2 points)")
    _, step, u0 = dahlquist()
    with pytest.raises(ValueError, match="more ranks"):
        solve(step, u0, [0.0, 1.0], comm)


def test_one_level_is_sequential_and_exact(comm: MPI.Comm) -> None:
    prob, step, u0 = dahlquist(nt=17)
    res = solve(step, u0, prob.t, comm, max_levels=1)
    assert res.iterations == 1 and res.levels == 1 and res.converged
    for j, u in zip(res.index, res.u, strict=True):
        assert float(u) == pytest.approx((1 / (1 + 5 / 16)) ** j, rel=1e-14)
    # the critical path of a sequential solve is every step
    assert res.critical_path == len(prob.t) - 1


# ---------------------------------------------------------------------------- LayerParallel
from torch import nn  # noqa: E402

from torchhpc.braid import LayerParallel  # noqa: E402


class _Step(nn.Module):
    """A residual branch tanh(W x + b) on 4 features."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _StepDt(nn.Module):
    """A step that applies dt itself (forward takes dt), with BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.bn = nn.BatchNorm1d(4, dtype=torch.float64)

    def forward(self, x: torch.Tensor, dt: float) -> torch.Tensor:
        return x + dt * torch.relu(self.bn(self.lin(x)))


def _open() -> nn.Module:
    return nn.Linear(3, 4, dtype=torch.float64)


def _close() -> nn.Module:
    return nn.Linear(4, 2, dtype=torch.float64)


def _run_and_compare(comm: MPI.Comm, lp: LayerParallel, x: torch.Tensor):
    """Forward+backward layer-parallel and serially; relative errors of output, input and parameter grads."""
    seq = lp.build_sequential_on_root()  # weights before the step (BatchNorm stats too)
    xp = x.clone().requires_grad_(True)
    y = lp(xp)
    (y.square().sum() + y.sum()).backward()
    mine = {(lp.layer_start + i, n): p.grad.clone() for i, m in enumerate(lp.layers)
            for n, p in m.named_parameters()}
    stats = {(lp.layer_start + i, n): b.clone() for i, m in enumerate(lp.layers)
             for n, b in m.named_buffers()}
    grads = comm.gather(mine, root=0)
    bufs = comm.gather(stats, root=0)
    errs = None
    if comm.Get_rank() == 0:
        xs = x.clone().requires_grad_(True)
        ys = seq(xs)
        (ys.square().sum() + ys.sum()).backward()
        merged = {k: v for part in grads for k, v in part.items()}
        merged_bufs = {k: v for part in bufs for k, v in part.items()}
        worst, worst_buf, count = 0.0, 0.0, 0
        for k, blk in enumerate(seq):
            mod = blk.layer if hasattr(blk, "layer") else blk
            # per layer: a bias in front of BatchNorm has a gradient that is zero up to round-off
            diff = torch.cat([(merged[(k, n)] - p.grad).reshape(-1) for n, p in mod.named_parameters()])
            ref = torch.cat([p.grad.reshape(-1) for _, p in mod.named_parameters()])
            worst = max(worst, float(diff.norm() / ref.norm()))
            count += len(list(mod.named_parameters()))
            for n, b in mod.named_buffers():
                worst_buf = max(worst_buf, float((merged_bufs[(k, n)] - b).double().norm()
                                                 / max(b.double().norm(), 1e-300)))
        assert count == len(merged), "every parameter of the serial net has a parallel gradient"
        y, ys = y.detach(), ys.detach()
        errs = (float((y - ys).norm() / ys.norm()), float((xp.grad - xs.grad).norm() / xs.grad.norm()), worst,
                worst_buf)
    errs = comm.bcast(errs, root=0)
    return y, errs


def test_layer_parallel_one_level_is_exact(comm: MPI.Comm) -> None:
    # 15 layers: uneven over 2 ranks (8 + 7) and 4 ranks (4 + 4 + 4 + 3)
    lp = LayerParallel(comm, [_open, _Step, _close], [1, 13, 1], Tf=2.0, max_fwd_levels=1,
                       max_bwd_levels=1)
    torch.manual_seed(0)
    x = torch.randn(6, 3, dtype=torch.float64)
    _, errs = _run_and_compare(comm, lp, x)
    assert max(errs) <= 1e-12, errs
    assert lp.getFwdStats()[0] == 1 and lp.getBwdStats()[0] == 1


@pytest.mark.parametrize("variant", ["V", "FMG+nested+skip"])
def test_layer_parallel_many_levels_enough_iterations_is_exact(comm: MPI.Comm, variant: str) -> None:
    lp = LayerParallel(comm, [_open, _Step, _close], [1, 14, 1], Tf=2.0, max_fwd_levels=3, max_bwd_levels=3,
                       max_iters=30)
    if variant != "V":
        lp.setFMG()  # F-cycles
        lp.setNestedIteration()
        lp.setSkipDowncycle(True)
    lp.setAbsTol(1e-15)  # iterate to round-off (or max_iters)
    lp.setMaxIters(12)
    torch.manual_seed(1)
    _, errs = _run_and_compare(comm, lp, torch.randn(5, 3, dtype=torch.float64))
    assert max(errs) <= 1e-12, errs


def test_layer_parallel_mgrit_converges_monotonically(comm: MPI.Comm) -> None:
    lp = LayerParallel(comm, [_Step], [16], Tf=2.0, max_fwd_levels=3, max_bwd_levels=3, max_iters=20)
    lp.setCFactor(2)
    lp.setNumRelax("F")
    lp.setAbsTol(1e-9)
    torch.manual_seed(2)
    y, errs = _run_and_compare(comm, lp, torch.randn(8, 4, dtype=torch.float64) * 2)
    assert max(errs[:3]) <= 1e-6, errs
    for its, res in (lp.getFwdStats(), lp.getBwdStats()):
        assert 2 < its < 20 and res[-1] < 1e-9, res
        assert all(b < a for a, b in zip(res, res[1:], strict=False)), res
    assert lp.last_fwd.levels == 3 and lp.last_bwd.levels == 3


def test_layer_parallel_batchnorm_and_dt_layers(comm: MPI.Comm) -> None:
    lp = LayerParallel(comm, [_open, _StepDt, _close], [1, 9, 1], Tf=1.0, max_fwd_levels=2, max_bwd_levels=2,
                       max_iters=10)
    lp.setAbsTol(1e-13)
    torch.manual_seed(3)
    _, errs = _run_and_compare(comm, lp, torch.randn(7, 3, dtype=torch.float64))
    # running statistics are updated exactly once per forward pass, as in the serial network
    assert max(errs) <= 1e-10, errs


def test_layer_parallel_rejects_dropout_in_training(comm: MPI.Comm) -> None:
    def drop() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), nn.Dropout(0.5))

    size = comm.Get_size()
    lp = LayerParallel(comm, [drop], [4 * size], Tf=1.0)
    with pytest.raises(ValueError, match=r"layer 0 contains .*Dropout.* in training mode"):
        lp(torch.zeros(2, 4, dtype=torch.float64))
    lp.eval()  # in eval mode dropout is the identity and allowed
    assert lp(torch.ones(2, 4, dtype=torch.float64)).shape == (2, 4)
    # dropout in the last layer only (owned by the last rank): every rank refuses, none waits for it
    last = LayerParallel(comm, [_Step, drop], [2 * size, 1], Tf=1.0, timeout=60)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=rf"layer {2 * size} contains .*Dropout"):
        last(torch.zeros(2, 4, dtype=torch.float64))
    assert time.monotonic() - t0 < 30


def test_gru_bad_chunk_on_one_rank_stops_every_rank(comm: MPI.Comm) -> None:
    from torchhpc.braid import GRUParallel

    gru = GRUParallel(comm, 2, 3, seed=0, dtype=torch.float64, timeout=60)
    steps = 0 if comm.Get_rank() == comm.Get_size() - 1 else 2  # the last rank passes an empty chunk
    with pytest.raises(ValueError, match=rf"ranks \[{comm.Get_size() - 1}\] passed other shapes"):
        gru(torch.zeros(1, steps, 2, dtype=torch.float64))


def test_layer_parallel_bad_arguments(comm: MPI.Comm) -> None:
    size = comm.Get_size()
    if size > 1:
        with pytest.raises(ValueError, match="more ranks"):
            LayerParallel(comm, [_Step], [size - 1], Tf=1.0)
    with pytest.raises(ValueError, match="Tf must be positive"):
        LayerParallel(comm, [_Step], [8], Tf=-1.0)
    lp = LayerParallel(comm, [_Step], [8], Tf=1.0, max_fwd_levels=2)
    with pytest.raises(ValueError, match="coarsening factor"):
        lp.setCFactor(1)
    with pytest.raises(ValueError, match="one step count per layer block"):
        LayerParallel(comm, [_Step, _Step], [8], Tf=1.0)


# ---------------------------------------------------------------------------- GRUs
from torchhpc.braid import GRUParallel, GRUSerial  # noqa: E402


@pytest.mark.parametrize(("levels", "iters", "bound"), [(1, 1, 1e-12), (3, 15, 1e-6)])
def test_gru_parallel_matches_serial(comm: MPI.Comm, levels: int, iters: int, bound: float) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    lengths = [16 // size] * size  # 16 steps at every rank count, in uneven chunks
    if size > 1:
        lengths[0], lengths[-1] = lengths[0] + 1, lengths[-1] - 1
    total = sum(lengths)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, total, 2, dtype=torch.float64, generator=gen)
    h0 = torch.randn(3, 4, dtype=torch.float64, generator=gen) * 0.5
    par = GRUParallel(comm, 2, 4, max_levels=levels, cfactor=2, max_iters=iters,
                      tol=1e-15 if bound < 1e-9 else 1e-10, seed=3, dtype=torch.float64)
    ser = GRUSerial(2, 4, seed=3, dtype=torch.float64)
    lo = sum(lengths[:rank])
    xl = x[:, lo:lo + lengths[rank]].clone().requires_grad_(True)
    h0p = h0.clone().requires_grad_(True)
    y, last = par(xl, h0p)
    ((y * y).sum() + last.sum()).backward()
    xs, h0s = x.clone().requires_grad_(True), h0.clone().requires_grad_(True)
    ys, lasts = ser(xs, h0s)
    # the parallel loss: local terms summed over ranks; the replicated final state counts once
    ((ys * ys).sum() + lasts.sum()).backward()
    ys_loc = ys[:, lo:lo + lengths[rank]]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    errs = [rel(y.detach(), ys_loc.detach()), rel(last.detach(), lasts.detach()),
            rel(xl.grad, xs.grad[:, lo:lo + lengths[rank]]), rel(h0p.grad, h0s.grad)]
    errs += [rel(p.grad, q.grad) for p, q in zip(par.parameters(), ser.parameters(), strict=True)]
    assert max(errs) <= bound, errs
    assert comm.allreduce(max(errs), op=MPI.MAX) <= bound
    if bound >= 1e-9:  # MGRIT setting: converged to the tolerance, residuals decreasing
        for res in (par.last_fwd, par.last_bwd):
            assert res.converged and 1 < res.iterations < 15, res.residuals
            assert all(b < a for a, b in zip(res.residuals, res.residuals[1:], strict=False)), res.residuals


# ---------------------------------------------------------------------------- deadlines
from torchhpc.braid import transport  # noqa: E402
from torchhpc.braid.transport import PeerTimeoutError  # noqa: E402
from torchhpc.runtime import waiting  # noqa: E402

_TMO = 0.1  # seconds; generous slack below for a loaded, oversubscribed machine
_SLACK = 6.0


def _late_rank_case(comm: MPI.Comm, call, pattern: str, callers: set[int] | None = None) -> None:
    """Ranks in ``callers`` (default: all but the last) call ``call(sub)`` on a fresh communicator; the
    last rank never joins.  The callers must raise PeerTimeoutError matching ``pattern`` within the
    deadline (plus slack).  The abandoned communicator is never used again, so later tests are unaffected.
    """
    sub = comm.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank in (set(range(size - 1)) if callers is None else callers):
        t0 = time.monotonic()
        with pytest.raises(PeerTimeoutError, match=pattern) as err:
            call(sub)
        elapsed = time.monotonic() - t0
        assert _TMO <= elapsed < _TMO + _SLACK, elapsed
        assert err.value.requests, "the pending operations are handed to the caller"
    comm.Barrier()  # the late rank waits here until the others have given up


_CAUSE = r"did not complete within 0\.1 s\. Likely cause: a peer rank died"


@pytest.mark.parametrize("op", ["dup", "barrier", "allreduce", "allgather", "bcast_tensor", "bcast_object",
                                "gather_object"])
def test_collective_with_a_missing_rank_times_out(comm: MPI.Comm, op: str) -> None:
    if comm.Get_size() < 2:
        pytest.skip("not at this rank count: needs a second rank that stays away")
    late = comm.Get_size() - 1  # bcast from the missing rank, gather to a present one: both must wait
    calls = {
        "dup": (lambda c: transport.dup(c, _TMO), r"MPI_Comm_idup"),
        "barrier": (lambda c: waiting.barrier(c, _TMO, "barrier (MPI_Ibarrier)", lambda: transport.timeout_message(
            "barrier (MPI_Ibarrier)", c, _TMO)), r"MPI_Ibarrier"),
        "allreduce": (lambda c: transport.allreduce(c, 1.5, "sum", _TMO, "residual"), r"residual \(MPI_Iallreduce"),
        "allgather": (lambda c: transport.allgather_int(c, 3, _TMO), r"MPI_Iallgather"),
        "bcast_tensor": (lambda c: transport.bcast_tensor(c, None, late, (2, 3), torch.float64, "cpu", _TMO),
                         rf"MPI_Ibcast from rank {late}"),
        "bcast_object": (lambda c: transport.bcast_object(c, None, late, _TMO),
                         rf"size \(MPI_Ibcast from rank {late}"),
        "gather_object": (lambda c: transport.gather_object(c, {"a": 1}, 0, _TMO), r"MPI_Igather to rank 0"),
    }
    call, what = calls[op]
    # a gather's contributors may finish without the root; only the root is bound to wait for everyone
    _late_rank_case(comm, call, rf"{what}.* on rank {comm.Get_rank()} of {comm.Get_size()} .*{_CAUSE}",
                    {0} if op == "gather_object" else None)


def test_solve_and_layer_parallel_with_a_missing_rank_time_out(comm: MPI.Comm) -> None:
    if comm.Get_size() < 2:
        pytest.skip("not at this rank count: needs a second rank that stays away")
    prob, step, u0 = dahlquist(nt=9)
    # a rank that never calls solve: the others stop at the first collective (the entry point's agreement
    # on errors), naming it
    _late_rank_case(comm, lambda c: solve(step, u0, prob.t, c, timeout=_TMO),
                    rf"MGRIT solve start \(error agreement, MPI_Iallgather\) on rank {comm.Get_rank()} .*{_CAUSE}")
    # a rank that builds the network but skips a forward pass: the others stop wherever they wait for it
    lp = LayerParallel(comm, [_Step], [2 * comm.Get_size()], Tf=1.0, timeout=_TMO)
    if comm.Get_rank() != comm.Get_size() - 1:
        t0 = time.monotonic()
        with pytest.raises(PeerTimeoutError, match=_CAUSE):
            lp(torch.zeros(2, 4, dtype=torch.float64))
        assert time.monotonic() - t0 < _TMO + _SLACK
    comm.Barrier()
