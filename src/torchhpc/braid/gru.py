"""GRUs over long sequences: ``GRUParallel`` solves the recurrence with MGRIT across ranks holding
consecutive chunks of the sequence (after Moon & Cyr, ICLR 2022); ``GRUSerial`` is its serial twin.

The GRU update ``h_t = h_{t-1} + (1 - z_t) (n_t - h_{t-1})`` is a forward-Euler step of unit
length.  On coarse levels a step over ``m`` time steps uses the semi-implicit form
``h' = (h + m (1 - z) n) / (1 + m (1 - z))`` (gates from the input at one end of the interval),
which stays a convex combination of ``h`` and ``n`` for any ``m`` where the explicit step
would not.  The fine level is the exact GRU, so converged results equal the serial network.
The backward pass is MGRIT on the adjoint recurrence with the output gradients as forcing;
weights are replicated and their gradients summed over ranks.
"""

from __future__ import annotations

import time

import torch
from mpi4py import MPI
from torch import nn

from ..runtime.waiting import agreed
from .layers import vjp
from .mgrit import MGRIT, MGRITResult
from .options import MGRITOptions
from .transport import (
    Channel,
    agreement_timeout,
    allgather_int,
    allreduce,
    bcast_tensor,
    check_timeout,
    dup,
    timeout_message,
)

__all__ = ["GRUSerial", "GRUParallel", "gru_coarse_step"]

_GY_TAG = 9100


def gru_coarse_step(cell: nn.GRUCell, x: torch.Tensor, h: torch.Tensor, m: int) -> torch.Tensor:
    """Semi-implicit GRU step over ``m`` unit steps with frozen gates (``m == 1`` is the exact cell)."""
    if m == 1:
        return cell(x, h)
    gi = nn.functional.linear(x, cell.weight_ih, cell.bias_ih)
    gh = nn.functional.linear(h, cell.weight_hh, cell.bias_hh)
    i_r, i_z, i_n = gi.chunk(3, dim=-1)
    h_r, h_z, h_n = gh.chunk(3, dim=-1)
    r = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    a = m * (1 - z)
    return (h + a * n) / (1 + a)


class GRUSerial(nn.Module):
    """One-layer GRU (batch first) stepped with ``nn.GRUCell``; same weights and names as GRUParallel."""

    def __init__(self, input_size: int, hidden_size: int, *, seed: int = 0, dtype: torch.dtype | None = None):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.cell = nn.GRUCell(input_size, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: (batch, time, input) -> (all hidden states (batch, time, hidden), last hidden state)."""
        h = x.new_zeros(x.shape[0], self.cell.hidden_size) if h0 is None else h0
        out = []
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
            out.append(h)
        return torch.stack(out, dim=1), h


class _GRUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gru: GRUParallel, counts: list[int], x: torch.Tensor, h0: torch.Tensor,
                *params: torch.Tensor):
        y, h_last, states, counts = gru._forward_solve(x, h0, counts)
        ctx.gru, ctx.x, ctx.states, ctx.counts = gru, x.detach(), states, counts
        return y, h_last

    @staticmethod
    def backward(ctx, gy: torch.Tensor, g_last: torch.Tensor):
        gx, gh0, gparams = ctx.gru._adjoint_solve(ctx.x, gy, g_last, ctx.states, ctx.counts)
        ctx.states = None
        return (None, None, gx, gh0, *gparams)


class GRUParallel(nn.Module):
    """A one-layer GRU whose time steps are spread over the ranks of ``comm``.

    Each rank passes its chunk of the sequence, ``x`` of shape (batch, T_rank, input), chunks in
    rank order (any lengths >= 1).  Returns this rank's hidden states and the final hidden state
    (on every rank).  Weights are the same on every rank (built from ``seed``, then broadcast from
    rank 0); call backward on every rank.
    """

    def __init__(self, comm: MPI.Comm, input_size: int, hidden_size: int, *, max_levels: int = 3,
                 cfactor: int = 4, max_iters: int = 10, tol: float = 1e-9, relax: str | int = "FCF",
                 seed: int = 0, dtype: torch.dtype | None = None, timeout: float | None = None) -> None:
        super().__init__()
        agree_s = agreement_timeout(timeout)
        with agreed(comm, agree_s, "GRUParallel()", lambda: timeout_message(  # an error on one rank: on all
                "GRUParallel construction (error agreement, MPI_Iallgather)", comm, agree_s)):
            timeout = check_timeout(timeout)
            settings = dict(max_levels=max_levels, cfactor=cfactor, max_iter=max_iters, tol=tol, relax=relax,
                            nested_iteration=False)
            fwd_opts, bwd_opts = MGRITOptions.build(**settings), MGRITOptions.build(**settings)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                cell = nn.GRUCell(input_size, hidden_size, dtype=dtype)
        self.comm = dup(comm, timeout, "GRUParallel construction (MPI_Comm_idup)")
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        # the adjoint runs backwards over the ranks: its own message space, logical ranks reversed
        self.rcomm = dup(self.comm, timeout, "GRUParallel construction (MPI_Comm_idup)")
        self._reversed = list(range(self.size - 1, -1, -1))
        self.cell = cell
        with torch.no_grad():
            for p in self.cell.parameters():
                p.copy_(bcast_tensor(self.comm, p, 0, p.shape, p.dtype, p.device, timeout,
                                     "GRUParallel construction: weights"))
        self.fwd_opts, self.bwd_opts = fwd_opts, bwd_opts
        self.timeout = timeout
        self.last_fwd: MGRITResult | None = None
        self.last_bwd: MGRITResult | None = None
        self.timers = {"forward": 0.0, "backward": 0.0}

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: this rank's (batch, T_rank, input) chunk; ``h0`` (batch, hidden) is taken from rank 0."""
        # every rank learns every chunk length, so a bad chunk anywhere stops every rank with the same error
        ok = x.ndim == 3 and x.shape[1] >= 1
        counts = allgather_int(self.comm, int(x.shape[1]) if ok else -1, self.timeout,
                               "GRUParallel forward: chunk lengths")
        if min(counts) < 1:
            bad = [r for r, c in enumerate(counts) if c < 1]
            raise ValueError(f"x must be (batch, time >= 1, input) on every rank; ranks {bad} passed other "
                             f"shapes (this rank: {tuple(x.shape)})")
        if h0 is None:
            h0 = x.new_zeros(x.shape[0], self.cell.hidden_size)
        return _GRUFn.apply(self, counts, x, h0, *self.cell.parameters())

    def _forward_solve(self, x: torch.Tensor, h0: torch.Tensor, counts: list[int]):
        t0 = time.perf_counter()
        start = sum(counts[:self.rank])
        n = sum(counts) + 1
        xd = x.detach()

        def x_at(t: int) -> torch.Tensor:  # input that leads to point t (t = 1 .. T)
            return xd[:, t - 1 - start]

        u0 = h0.detach() if self.rank == 0 else torch.zeros_like(h0)
        def phi(u: torch.Tensor, i0: int, i1: int) -> torch.Tensor:  # runs on the rank holding x_{i1}
            return gru_coarse_step(self.cell, x_at(i1), u, i1 - i0)

        solver = MGRIT(phi, u0, n, self.comm, self.fwd_opts, counts=[counts[0] + 1, *counts[1:]],
                       init=lambda j: torch.zeros_like(u0), timeout=self.timeout)
        res = solver.run()
        states = dict(zip(res.index, res.u, strict=True))
        if res.ghost is not None:
            states[res.index[0] - 1] = res.ghost
        y = torch.stack([states[t] for t in range(start + 1, start + counts[self.rank] + 1)], dim=1)
        last = bcast_tensor(self.comm, states.get(n - 1), self.size - 1, h0.shape, h0.dtype, x.device,
                            self.timeout, "GRUParallel forward: last hidden state")
        self.last_fwd = res
        self.timers["forward"] += time.perf_counter() - t0
        return y, last, states, counts

    def _adjoint_solve(self, x: torch.Tensor, gy: torch.Tensor, g_last: torch.Tensor,
                       states: dict[int, torch.Tensor], counts: list[int]):
        t0 = time.perf_counter()
        n_steps, start = sum(counts), sum(counts[:self.rank])
        count = counts[self.rank]
        # forcing at forward point t is dL/dh_t; this rank's adjoint steps need t = start .. start+count-1,
        # so the gradient at its first point comes from the previous rank
        gyd = {start + 1 + i: gy[:, i].detach() for i in range(count)}
        ch = Channel(self.comm, self.timeout)
        if self.rank + 1 < self.size:
            ch.send(gyd[start + count], self.rank + 1, _GY_TAG)
        if self.rank > 0:
            gyd[start] = ch.recv(self.rank - 1, _GY_TAG, gy.device)
        ch.flush()

        def x_at(t: int) -> torch.Tensor:
            return x[:, t - 1 - start]

        def psi(w: torch.Tensor, j0: int, j1: int) -> torch.Tensor:
            a, b = n_steps - j1, n_steps - j0
            with torch.enable_grad():
                h = states[a].detach().requires_grad_(True)
                out = gru_coarse_step(self.cell, x_at(a + 1), h, b - a)
                (g,) = vjp([out], [h], [w])
            f = gyd.get(a)
            return g if f is None else g + f

        w0 = (gyd[n_steps] + g_last.detach()) if self.rank == self.size - 1 else torch.zeros_like(g_last)
        solver = MGRIT(psi, w0, n_steps + 1, self.rcomm, self.bwd_opts,
                       counts=[counts[-1] + 1, *reversed(counts[:-1])], init=lambda j: torch.zeros_like(w0),
                       timeout=self.timeout, order=self._reversed)
        res = solver.run()
        lam = {n_steps - j: w for j, w in zip(res.index, res.u, strict=True)}
        if res.ghost is not None:
            lam[n_steps - res.index[0] + 1] = res.ghost
        params = list(self.cell.parameters())
        with torch.enable_grad():
            xs = x.detach().requires_grad_(True)
            outs = [self.cell(xs[:, i], states[start + i].detach()) for i in range(count)]
            cots = [lam[start + 1 + i] for i in range(count)]
            *gp, gx = vjp(outs, [*params, xs], cots)
        flat = torch.cat([g.reshape(-1) for g in gp]).cpu()
        total = torch.from_numpy(allreduce(self.comm, flat.numpy(), "sum", self.timeout,
                                           "GRUParallel backward: weight gradients"))
        gparams, off = [], 0
        for p in params:
            gparams.append(total[off:off + p.numel()].view_as(p).to(p.device))
            off += p.numel()
        gh0 = bcast_tensor(self.comm, lam.get(0), 0, g_last.shape, g_last.dtype, g_last.device, self.timeout,
                           "GRUParallel backward: initial-state gradient")
        self.last_bwd = res
        self.timers["backward"] += time.perf_counter() - t0
        return gx, gh0, gparams
