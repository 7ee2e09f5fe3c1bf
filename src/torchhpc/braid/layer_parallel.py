"""``LayerParallel``: a network of layers run as time steps, forward and adjoint solved by MGRIT over ranks.

Layer ``k`` maps the state at point ``k`` to point ``k+1``.  Rank ``r`` owns a contiguous block of
layers (an even split; the first ``N % P`` ranks get one more) and the states after them; rank 0
also holds the input.  The forward pass is MGRIT over the ``N + 1`` points; the backward pass is
MGRIT on the adjoint ``lambda_k = J_k^T lambda_{k+1}`` in reverse order on the same ranks (a
reversed communicator), linearised at the stored forward states.  Parameter gradients then follow
from the converged adjoint on the rank that owns each layer (Günther, Ruthotto, Schroder, Cyr,
Gauger 2020; torchbraid).

Coarse levels re-discretise: a coarse step over fine layers ``[i0, i1)`` takes one ODE step of
the first layer of each run of ODE layers with the run's total ``dt``, and applies ordinary
(used-once) layers exactly.  Weights that a rank needs for such steps but does not own are sent
by their owners at the start of each forward pass.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from mpi4py import MPI
from torch import nn

from ..runtime.waiting import agreed
from . import xbraid
from .grid import Hierarchy, even_split
from .layers import (
    LayerSpec,
    ODEBlock,
    bn_training,
    build_layer,
    call_layer,
    dropout_error,
    dropout_in_training,
    ode_step,
    takes_dt,
    vjp,
)
from .mgrit import MGRIT, MGRITResult
from .options import MGRITOptions, relax_sweeps
from .transport import (
    Channel,
    agreement_timeout,
    allreduce,
    bcast_object,
    bcast_tensor,
    check_timeout,
    dup,
    gather_object,
    timeout_message,
)

__all__ = ["LayerParallel"]

_LAYER_TAG = 9000
_GHOST_TAG = 9001


class _LayerParallelFn(torch.autograd.Function):
    """Forward: MGRIT over layers; backward: MGRIT on the adjoint plus local parameter gradients."""

    @staticmethod
    def forward(ctx, lp: LayerParallel, args: tuple, kwargs: dict, x: torch.Tensor, *params: torch.Tensor):
        y, states, x_meta = lp._forward_solve(x, args, kwargs)
        ctx.lp, ctx.args, ctx.kwargs, ctx.states, ctx.x_meta = lp, args, kwargs, states, x_meta
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        gx, gparams = ctx.lp._adjoint_solve(gy, ctx.states, ctx.args, ctx.kwargs, ctx.x_meta)
        ctx.states = None
        return (None, None, None, gx, *gparams)


class LayerParallel(nn.Module):
    """A chain of layers trained layer-parallel with MGRIT (collective over ``comm``).

    ``layer_blocks[b]`` is a constructor (or a module to copy) for block ``b`` and
    ``global_steps[b]`` its number of steps: a block used once is an ordinary layer, a block
    of several steps is an ODE block ``x + dt * layer(x)`` (``layer(x, dt=dt)`` when its forward
    takes ``dt``) with fresh weights per step and ``dt = Tf / sum(global_steps)``.

    Every rank calls forward (the input is taken from rank 0) and gets the output; every rank
    must then call backward on a loss built from it.  ``parameters()`` are this rank's layers.
    With one level (``max_fwd_levels = max_bwd_levels = 1``) forward and backward are exact.
    ``engine="xbraid"`` runs both solves on XBraid's C library (``make native``): layers are then split as
    XBraid splits the ``N + 1`` points (the owner of point ``k + 1`` owns layer ``k``), the adjoint runs on
    XBraid's reverted ranks, and residual histories follow XBraid (see :mod:`torchhpc.braid.xbraid`).
    No wait on other ranks lasts longer than ``timeout`` seconds (default
    :func:`~torchhpc.braid.transport.default_timeout`); past it a
    :class:`~torchhpc.braid.transport.PeerTimeoutError` names the operation and the rank.
    """

    def __init__(self, comm: MPI.Comm, layer_blocks: Sequence[LayerSpec], global_steps: Sequence[int],
                 Tf: float, max_fwd_levels: int = 1, max_bwd_levels: int = 1, max_iters: int = 10, *,
                 seed: int = 0, timeout: float | None = None, engine: str = "python") -> None:
        super().__init__()
        agree_s = agreement_timeout(timeout)
        with agreed(comm, agree_s, "LayerParallel()", lambda: timeout_message(  # an error on one rank: on all
                "LayerParallel construction (error agreement, MPI_Iallgather)", comm, agree_s)):
            if engine not in ("python", "xbraid"):
                raise ValueError(f"engine must be 'python' or 'xbraid', got {engine!r}")
            if engine == "xbraid":
                xbraid.load()  # EngineUnavailableError, naming what is missing and `make native-xbraid`
            if len(layer_blocks) != len(global_steps) or not layer_blocks:
                raise ValueError(f"need one step count per layer block, got {len(layer_blocks)} blocks and "
                                 f"{len(global_steps)} counts")
            if any(int(s) != s or s < 1 for s in global_steps):
                raise ValueError(f"every block needs a whole number of steps >= 1, got {list(global_steps)}")
            if not Tf > 0:
                raise ValueError(f"final time Tf must be positive, got {Tf}")
            size = comm.Get_size()
            self.nlayers = int(sum(global_steps))
            if size > self.nlayers:
                raise ValueError(f"more ranks ({size}) than layers ({self.nlayers}): every rank must own a layer")
            timeout = check_timeout(timeout)
        self.comm = dup(comm, timeout, "LayerParallel construction (MPI_Comm_idup)")
        self.rank, self.size = self.comm.Get_rank(), size
        # the adjoint runs backwards over the ranks: its own message space, logical ranks reversed
        self.rcomm = dup(self.comm, timeout, "LayerParallel construction (MPI_Comm_idup)")
        self._reversed = list(range(size - 1, -1, -1))
        self.Tf, self.dt, self.seed, self.timeout = float(Tf), float(Tf) / self.nlayers, seed, timeout
        self._specs = list(layer_blocks)
        self._block_of: list[int] = []
        self._block_end: list[int] = []
        for b, steps in enumerate(global_steps):
            end = len(self._block_of) + int(steps)
            self._block_of += [b] * int(steps)
            self._block_end += [end] * int(steps)
        self._ode = [global_steps[self._block_of[k]] > 1 for k in range(self.nlayers)]
        self.engine = engine
        if engine == "xbraid":  # the owner of point k + 1 owns layer k, points split as XBraid splits them
            points = xbraid.block_counts(self.nlayers + 1, size)
            self.layer_counts = [points[0] - 1, *points[1:]]
            # XBraid's own messages get their own communicators (its waits have no deadline of ours)
            self._xcomm = dup(self.comm, timeout, "LayerParallel construction (MPI_Comm_idup)")
            self._xrcomm = dup(self.comm, timeout, "LayerParallel construction (MPI_Comm_idup)")
        else:
            self.layer_counts = even_split(self.nlayers, size)
        self.layer_start = sum(self.layer_counts[:self.rank])
        owned = range(self.layer_start, self.layer_start + self.layer_counts[self.rank])
        self.layers = nn.ModuleList([self._build(k) for k in owned])
        self._takes_dt = [takes_dt(m) for m in self.layers]
        self._cache: dict[int, nn.Module] = {}
        self._plan: tuple[list[tuple[int, int]], list[int]] = ([], [])
        self._plan_key: tuple | None = None
        self._shapes: dict[tuple, list[torch.Size]] = {}
        self.fwd_opts = MGRITOptions.build(max_levels=max_fwd_levels, max_iter=max_iters, tol=1e-9,
                                           nested_iteration=False)
        self.bwd_opts = MGRITOptions.build(max_levels=max_bwd_levels, max_iter=max_iters, tol=1e-9,
                                           nested_iteration=False)
        self._fwd_stats: tuple[int, list[float]] = (0, [])
        self._bwd_stats: tuple[int, list[float]] = (0, [])
        self._timers: dict[str, float] = {"forward": 0.0, "backward": 0.0, "fwd_step": 0.0, "bwd_step": 0.0,
                                          "weights": 0.0}
        self.last_fwd: MGRITResult | None = None
        self.last_bwd: MGRITResult | None = None

    # ------------------------------------------------------------------ layers
    def _build(self, k: int) -> nn.Module:
        return build_layer(self._specs[self._block_of[k]], self.seed * 1_000_003 + k)

    def _owns(self, k: int) -> bool:
        return self.layer_start <= k < self.layer_start + len(self.layers)

    def _layer(self, k: int) -> nn.Module:
        if self._owns(k):
            return self.layers[k - self.layer_start]
        if k not in self._cache:
            raise RuntimeError(f"rank {self.rank} needs layer {k} but neither owns nor received it")
        return self._cache[k]

    def _pieces(self, i0: int, i1: int) -> list[tuple[int, int]]:
        """(first layer, number of fine steps) of each piece of the propagator over ``[i0, i1)``."""
        out, k = [], i0
        while k < i1:
            end = min(i1, self._block_end[k]) if self._ode[k] else k + 1
            out.append((k, end - k))
            k = end
        return out

    def _prop(self, x: torch.Tensor, i0: int, i1: int, args: tuple, kwargs: dict,
              pure: bool = True) -> torch.Tensor:
        """Propagate from point i0 to i1: exact on the fine grid, re-discretised on coarse grids."""
        for k, nsteps in self._pieces(i0, i1):
            layer = self._layer(k)
            if self._ode[k]:
                x = ode_step(layer, x, nsteps * self.dt, args, kwargs, takes_dt(layer), pure)
            else:
                x = call_layer(layer, x, args, kwargs, pure)
        return x

    def _hierarchies(self) -> tuple[Hierarchy, Hierarchy]:
        n, c = self.nlayers + 1, self.layer_counts
        fwd = Hierarchy(n, [c[0] + 1, *c[1:]], self.fwd_opts.cfactor, self.fwd_opts.max_levels,
                        self.fwd_opts.min_coarse)
        # the adjoint's points by logical rank (reversed ranks): the Python engine shifts them by one point,
        # XBraid's reverted ranks keep each rank's forward points
        bwd_counts = list(reversed(fwd.counts)) if self.engine == "xbraid" else [c[-1] + 1, *reversed(c[:-1])]
        bwd = Hierarchy(n, bwd_counts, self.bwd_opts.cfactor, self.bwd_opts.max_levels, self.bwd_opts.min_coarse)
        return fwd, bwd

    def _intervals(self, h: Hierarchy, rank: int) -> set[tuple[int, int]]:
        """Fine intervals ``rank`` may step over in a solve on ``h``.  XBraid also steps from a rank's last
        point into the next rank's first one, so for it every step touching the rank's points counts."""
        if self.engine != "xbraid":
            return h.intervals(rank)
        out = set()
        for lvl in range(h.nlevels):
            s = h.strides[lvl]
            for j in range(1, h.sizes[lvl]):
                if rank in (h.owner((j - 1) * s), h.owner(j * s)):
                    out.add(((j - 1) * s, j * s))
        return out

    def _needed_layers(self, rank: int, fwd: Hierarchy, bwd: Hierarchy) -> set[int]:
        need = set()
        for i0, i1 in self._intervals(fwd, rank):
            need.update(k for k, _ in self._pieces(i0, i1))
        n = self.nlayers
        for j0, j1 in self._intervals(bwd, self.size - 1 - rank):
            need.update(k for k, _ in self._pieces(n - j1, n - j0))
        return need

    def _layer_plan(self) -> tuple[list[tuple[int, int]], list[int]]:
        """(rank, layer) pairs this rank sends and the layers it receives; recomputed when the levels change."""
        key = tuple((o.max_levels, tuple(o.cfactor), o.min_coarse) for o in (self.fwd_opts, self.bwd_opts))
        if self._plan_key == key:
            return self._plan
        fwd, bwd = self._hierarchies()
        sends: list[tuple[int, int]] = []
        recvs: list[int] = []
        if fwd.nlevels > 1 or bwd.nlevels > 1 or self.engine == "xbraid":  # XBraid's adjoint: always
            for r in range(self.size):
                need = sorted(self._needed_layers(r, fwd, bwd))
                if r == self.rank:
                    recvs = [k for k in need if not self._owns(k)]
                else:
                    sends += [(r, k) for k in need if self._owns(k)]
        self._plan, self._plan_key = (sends, recvs), key
        return self._plan

    def _exchange_layers(self, device: torch.device) -> None:
        """Send owned weights to the ranks whose coarse steps use them; receive the ones this rank uses."""
        sends, recvs = self._layer_plan()
        if not sends and not recvs:
            return
        t0 = time.perf_counter()
        ch = Channel(self.comm, self.timeout)
        owner = [r for r, c in enumerate(self.layer_counts) for _ in range(c)]
        for r, k in sends:
            for t in self._layer(k).state_dict().values():
                ch.send(t, r, _LAYER_TAG)
        for k in recvs:
            if k not in self._cache:
                self._cache[k] = self._build(k).to(device)
            layer = self._cache[k]
            state = layer.state_dict()
            received = {name: ch.recv(owner[k], _LAYER_TAG, device) for name in state}
            layer.load_state_dict(received)
            layer.train(self.training)
        ch.flush()
        self._timers["weights"] += time.perf_counter() - t0

    def _point_shapes(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> list[torch.Size]:
        """State shape at every point, for zero initial guesses.

        ODE steps keep the shape; each ordinary layer is run once on zeros (a fresh copy in eval
        mode, no grad) to learn its output shape.  Cached per input shape.
        """
        key = (tuple(shape), dtype)
        if key not in self._shapes:
            shapes, x = [torch.Size(shape)], None
            for k in range(self.nlayers):
                if not self._ode[k]:
                    if x is None or x.shape != shapes[-1]:
                        x = torch.zeros(shapes[-1], dtype=dtype, device=device)
                    with torch.no_grad():
                        x = self._build(k).to(device).eval()(x)
                shapes.append(shapes[-1] if self._ode[k] else x.shape)
            self._shapes[key] = shapes
        return self._shapes[key]

    # ------------------------------------------------------------------ passes
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Run the network on ``x`` (rank 0's input counts); extra args reach every layer."""
        # collective check, so that every rank refuses the pass, not only the owner of the bad layer
        n = self.nlayers
        bad = next((self.layer_start + i for i, m in enumerate(self.layers) if dropout_in_training(m)), n)
        first = allreduce(self.comm, bad, "min", self.timeout, "LayerParallel forward: layer checks")
        if first < n:
            drop = dropout_in_training(self.layers[first - self.layer_start]) if self._owns(first) else None
            raise dropout_error(first, f"{type(drop).__name__}(p={drop.p})" if drop is not None else "Dropout")
        return _LayerParallelFn.apply(self, args, kwargs, x, *self.layers.parameters())

    def _forward_solve(self, x: torch.Tensor, args: tuple, kwargs: dict):
        t0 = time.perf_counter()
        device = x.device
        shape, dtype = bcast_object(self.comm, (x.shape, x.dtype) if self.rank == 0 else None, 0, self.timeout,
                                    "LayerParallel forward: input shape")
        self._exchange_layers(device)
        shapes = self._point_shapes(shape, dtype, device)
        u0 = x.detach() if self.rank == 0 else torch.zeros(shape, dtype=dtype, device=device)
        c = self.layer_counts
        def zeros(j: int) -> torch.Tensor:
            return torch.zeros(shapes[j], dtype=dtype, device=device)

        def phi(u: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
            return self._prop(u, i0, i1, args, kwargs)

        if self.engine == "xbraid":
            res = self._xbraid(phi, u0, self._xcomm, self.fwd_opts, zeros, shapes, dtype, reverted=False)
            self._timers["fwd_step"] += res.timers["step"]
            res.ghost = self._ghost(res, device)
        else:
            solver = MGRIT(phi, u0, self.nlayers + 1, self.comm, self.fwd_opts, counts=[c[0] + 1, *c[1:]],
                           init=zeros, timeout=self.timeout)
            res = solver.run()
            self._timers["fwd_step"] += res.timers["step"]
        states = dict(zip(res.index, res.u, strict=True))
        if res.ghost is not None:
            states[res.index[0] - 1] = res.ghost
        with torch.no_grad():  # BatchNorm running statistics: one update per layer from the converged input
            for i, layer in enumerate(self.layers):
                if bn_training(layer):
                    k = self.layer_start + i
                    self._prop(states[k], k, k + 1, args, kwargs, pure=False)
        y = bcast_tensor(self.comm, states.get(self.nlayers), self.size - 1, shapes[-1], dtype, device,
                         self.timeout, "LayerParallel forward: output")
        self.last_fwd = res
        self._fwd_stats = (res.iterations, list(res.residuals))
        self._timers["forward"] += time.perf_counter() - t0
        return y, states, (shape, dtype)

    def _xbraid(self, phi, u0: torch.Tensor, comm: MPI.Comm, opts: MGRITOptions, init, shapes: list[torch.Size],
                dtype: torch.dtype, reverted: bool) -> MGRITResult:
        """One solve over the N + 1 points on XBraid; this rank's points as an :class:`MGRITResult`."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        max_bytes = max(int(torch.Size(s).numel()) for s in shapes) * itemsize
        out = xbraid.run(phi, u0, self.nlayers + 1, comm, opts, init=init, max_bytes=max_bytes, reverted=reverted,
                         timeout=self.timeout)
        idx = list(out["u"])
        return MGRITResult(u=list(out["u"].values()), t=[float(j) for j in idx], index=idx,
                           residuals=out["residuals"], iterations=out["iterations"], converged=out["converged"],
                           levels=out["levels"], steps=out["steps"],
                           timers={"solve": out["solve"], "step": out["t_step"]})

    def _ghost(self, res: MGRITResult, device: torch.device) -> torch.Tensor | None:
        """The state just before this rank's first point (input of its first layer), from the previous rank."""
        ch = Channel(self.comm, self.timeout)
        if self.rank + 1 < self.size:
            ch.send(res.u[-1], self.rank + 1, _GHOST_TAG)
        ghost = ch.recv(self.rank - 1, _GHOST_TAG, device) if self.rank > 0 else None
        ch.flush()
        return ghost

    def _vjp(self, u: torch.Tensor, w: torch.Tensor, a: int, b: int, args: tuple,
             kwargs: dict) -> torch.Tensor:
        """Adjoint of the propagator over [a, b), linearised at the forward state u at point a."""
        with torch.enable_grad():
            xin = u.detach().requires_grad_(True)
            y = self._prop(xin, a, b, args, kwargs)
            (g,) = vjp([y], [xin], [w], allow_unused=True)
        return torch.zeros_like(u) if g is None else g

    def _adjoint_solve(self, gy: torch.Tensor, states: dict[int, torch.Tensor], args: tuple, kwargs: dict,
                       x_meta: tuple):
        t0 = time.perf_counter()
        n, c, device = self.nlayers, self.layer_counts, gy.device
        shapes = self._point_shapes(*x_meta, device)
        w0 = gy.detach() if self.rank == self.size - 1 else torch.zeros_like(gy)
        def psi(w: torch.Tensor, j0: int, j1: int) -> torch.Tensor:
            return self._vjp(states[n - j1], w, n - j1, n - j0, args, kwargs)

        def zeros(j: int) -> torch.Tensor:
            return torch.zeros(shapes[n - j], dtype=gy.dtype, device=device)

        if self.engine == "xbraid":  # reverted ranks: each rank's adjoint points are its forward points
            res = self._xbraid(psi, w0, self._xrcomm, self.bwd_opts, zeros, shapes, gy.dtype, reverted=True)
        else:
            solver = MGRIT(psi, w0, n + 1, self.rcomm, self.bwd_opts, counts=[c[-1] + 1, *reversed(c[:-1])],
                           init=zeros, timeout=self.timeout, order=self._reversed)
            res = solver.run()
        lam = {n - j: w for j, w in zip(res.index, res.u, strict=True)}  # lambda by forward point
        if res.ghost is not None:
            lam[n - res.index[0] + 1] = res.ghost
        params = list(self.layers.parameters())
        grads: list[torch.Tensor | None] = [None] * len(params)
        if params:
            with torch.enable_grad():
                outs, cots = [], []
                for i, _layer in enumerate(self.layers):
                    k = self.layer_start + i
                    outs.append(self._prop(states[k].detach(), k, k + 1, args, kwargs))
                    cots.append(lam[k + 1])
                grads = list(vjp(outs, params, cots, allow_unused=True))
        gx = bcast_tensor(self.comm, lam.get(0), 0, shapes[0], gy.dtype, device, self.timeout,
                          "LayerParallel backward: input gradient")
        self.last_bwd = res
        self._bwd_stats = (res.iterations, list(res.residuals))
        self._timers["backward"] += time.perf_counter() - t0
        self._timers["bwd_step"] += res.timers["step"]
        return gx, grads

    # ------------------------------------------------------------------ serial twin
    def build_sequential_on_root(self) -> nn.Sequential | None:
        """Collective: the equivalent serial network (current weights) on rank 0, None elsewhere."""
        mine = {self.layer_start + i: {k: v.detach().cpu() for k, v in m.state_dict().items()}
                for i, m in enumerate(self.layers)}
        gathered = gather_object(self.comm, mine, 0, self.timeout, "build_sequential_on_root: weights")
        if self.rank != 0:
            return None
        states = {k: s for part in gathered for k, s in part.items()}
        seq = []
        for k in range(self.nlayers):
            layer = self._build(k)
            layer.load_state_dict(states[k])
            seq.append(ODEBlock(layer, self.dt) if self._ode[k] else layer)
        return nn.Sequential(*seq)

    # ------------------------------------------------------------------ settings (torchbraid names)
    @staticmethod
    def _set_level(values: list, value, level: int) -> list:
        if level < 0:
            return [value]
        out = list(values) + [values[-1]] * max(0, level + 1 - len(values))
        out[level] = value
        return out

    def _both(self, fwd: bool = True, bwd: bool = True) -> list[MGRITOptions]:
        return [o for o, on in ((self.fwd_opts, fwd), (self.bwd_opts, bwd)) if on]

    def setCFactor(self, cf: int, level: int = -1) -> None:  # noqa: N802 - torchbraid's API
        """Coarsening factor for all levels (level = -1) or one level, forward and backward."""
        if int(cf) != cf or cf < 2:
            raise ValueError(f"coarsening factor must be an int >= 2, got {cf}")
        for o in self._both():
            o.cfactor = self._set_level(o.cfactor, int(cf), level)

    def setNumRelax(self, relax: int | str, level: int = -1) -> None:  # noqa: N802
        """CF sweeps after the first F-relaxation (0 = F, 1 = FCF), forward and backward."""
        self.setFwdNumRelax(relax, level)
        self.setBwdNumRelax(relax, level)

    def setFwdNumRelax(self, relax: int | str, level: int = -1) -> None:  # noqa: N802
        self.fwd_opts.relax = self._set_level(self.fwd_opts.relax, relax_sweeps(relax), level)

    def setBwdNumRelax(self, relax: int | str, level: int = -1) -> None:  # noqa: N802
        self.bwd_opts.relax = self._set_level(self.bwd_opts.relax, relax_sweeps(relax), level)

    def setMaxIters(self, n: int) -> None:  # noqa: N802
        self.setFwdMaxIters(n)
        self.setBwdMaxIters(n)

    def setFwdMaxIters(self, n: int) -> None:  # noqa: N802
        self._check_iters(n)
        self.fwd_opts.max_iter = int(n)

    def setBwdMaxIters(self, n: int) -> None:  # noqa: N802
        self._check_iters(n)
        self.bwd_opts.max_iter = int(n)

    @staticmethod
    def _check_iters(n: int) -> None:
        if int(n) != n or n < 1:
            raise ValueError(f"maximum iterations must be an int >= 1, got {n}")

    def setAbsTol(self, tol: float) -> None:  # noqa: N802
        self.setFwdAbsTol(tol)
        self.setBwdAbsTol(tol)

    def setFwdAbsTol(self, tol: float) -> None:  # noqa: N802
        self.fwd_opts.tol = self._check_tol(tol)

    def setBwdAbsTol(self, tol: float) -> None:  # noqa: N802
        self.bwd_opts.tol = self._check_tol(tol)

    def setRelTol(self, tol: float) -> None:  # noqa: N802
        self.setFwdRelTol(tol)
        self.setBwdRelTol(tol)

    def setFwdRelTol(self, tol: float) -> None:  # noqa: N802
        self.fwd_opts.rtol = self._check_tol(tol)

    def setBwdRelTol(self, tol: float) -> None:  # noqa: N802
        self.bwd_opts.rtol = self._check_tol(tol)

    @staticmethod
    def _check_tol(tol: float) -> float:
        if not tol >= 0:
            raise ValueError(f"tolerance must be >= 0, got {tol}")
        return float(tol)

    def setFwdMaxLevels(self, n: int) -> None:  # noqa: N802
        self.fwd_opts.max_levels = int(n)
        self.fwd_opts.validate()

    def setBwdMaxLevels(self, n: int) -> None:  # noqa: N802
        self.bwd_opts.max_levels = int(n)
        self.bwd_opts.validate()

    def setCycle(self, cycle: str) -> None:  # noqa: N802
        """'V' or 'F' cycles, forward and backward."""
        if cycle not in ("V", "F"):
            raise ValueError(f"cycle must be 'V' or 'F', got {cycle!r}")
        for o in self._both():
            o.cycle = cycle

    def setSkipDowncycle(self, skip: bool) -> None:  # noqa: N802
        """XBraid's skip: no work on the first down-cycle (start from the coarsest solve), fwd and bwd."""
        for o in self._both():
            o.skip_downcycle = bool(skip)

    def setFMG(self, enable: bool = True) -> None:  # noqa: N802
        """FMG as in XBraid's ``braid_SetFMG`` and torchbraid: F-cycles (``False``: back to V-cycles)."""
        self.setCycle("F" if enable else "V")

    def setNestedIteration(self, enable: bool = True) -> None:  # noqa: N802
        """pymgrit's nested iteration: an initial guess from the coarse grids, refined level by level."""
        for o in self._both():
            o.nested_iteration = bool(enable)

    def setCRelaxWt(self, weight: float) -> None:  # noqa: N802
        for o in self._both():
            o.weight_c = float(weight)
            o.validate()

    def setMinCoarse(self, n: int) -> None:  # noqa: N802
        for o in self._both():
            o.min_coarse = int(n)
            o.validate()

    def setPrintLevel(self, level: int) -> None:  # noqa: N802
        """0: silent; 1: residual per iteration on rank 0."""
        for o in self._both():
            o.print_level = int(level)

    def getFwdStats(self) -> tuple[int, list[float]]:  # noqa: N802
        """(iterations, residual history) of the last forward solve."""
        return self._fwd_stats

    def getBwdStats(self) -> tuple[int, list[float]]:  # noqa: N802
        """(iterations, residual history) of the last backward solve."""
        return self._bwd_stats

    def getTimers(self) -> dict[str, float]:  # noqa: N802
        """Accumulated seconds: forward, backward, their step evaluations, and weight exchange."""
        return dict(self._timers)

    def getTimersString(self) -> str:  # noqa: N802
        return "  ".join(f"{k}={v:.4f}s" for k, v in self._timers.items())

    def getMPIComm(self) -> MPI.Comm:  # noqa: N802
        return self.comm
