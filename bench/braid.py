"""Layer-parallel ResNet: MGRIT forward+backward against the serial network, and a speedup model.

    flock /tmp/torchhpc-bench.lock python bench/braid.py            # 32, 128, 256 steps at 1, 2, 4 ranks
    python bench/braid.py --quick                                   # 32 steps at 1 and 2 ranks, seconds
    flock /tmp/torchhpc-bench.lock python bench/braid.py --engines  # XBraid engine vs Python engine

``--engines``: wall time per MGRIT iteration of ``mgrit.solve`` on XBraid (``engine="xbraid"``, needs
``make native``) against the Python engine, same problem, same settings, same mpiexec job, a fixed number of
cycles (tol=0), rounds alternating which engine goes first; the ratio is taken per round and its median and
range over the rounds are reported.

For each depth and rank count, one mpiexec job times forward+backward of ``LayerParallel`` and,
on rank 0 in the same job, of the equivalent serial ``nn.Sequential`` (so every wall time is a
ratio to a baseline measured in the same run).  It also reports the machine-independent figures
that bound speedup: MGRIT iterations, step evaluations on the critical path (a logical clock
carried by every message) and in total, against the serial count (N forward + N backward).

The speedup curve for 16..1024 ranks is a MODEL, not a measurement: critical-path step counts
of the same cycle computed analytically (checked against the measured counts at 1, 2, 4 ranks),
priced with the step, adjoint-step and message costs measured here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

RESULT = "BRAID_RESULT "


# ----------------------------------------------------------------------------- worker (under mpiexec)
def worker(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI
    from torch import nn

    from torchhpc.braid import LayerParallel
    from torchhpc.braid.transport import allreduce, barrier, bcast_object, default_timeout, wait_all

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    c = args.channels
    tmo = default_timeout()  # every wait on a peer ends in an error, never a hang

    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.conv(x))

    lp = LayerParallel(comm, [Step], [args.steps], Tf=1.0, max_fwd_levels=args.levels,
                       max_bwd_levels=args.levels, max_iters=args.iters)
    lp.setCFactor(args.cfactor)
    lp.setAbsTol(args.tol)
    serial = lp.build_sequential_on_root()
    x = torch.randn(args.batch, c, 8, 8, generator=torch.Generator().manual_seed(0))

    def par_step() -> None:
        lp.zero_grad()
        xx = x.clone().requires_grad_(True)
        lp(xx).square().sum().backward()

    par_step()  # warm-up
    barrier(comm, tmo)
    t0 = time.perf_counter()
    for _ in range(args.reps):
        par_step()
    t_par = allreduce(comm, time.perf_counter() - t0, "max", tmo) / args.reps
    fwd, bwd = lp.last_fwd, lp.last_bwd
    total_steps = allreduce(comm, fwd.steps + bwd.steps + len(lp.layers), "sum", tmo)
    crit = fwd.critical_path + bwd.critical_path + max(lp.layer_counts)  # + local parameter-gradient pass

    # message cost of one state between two ranks (ping-pong), for the model
    alpha = 0.0
    if size > 1:
        buf = x.numpy().copy()
        barrier(comm, tmo)
        t0 = time.perf_counter()
        for _ in range(20):
            if rank == 0:
                wait_all([comm.Isend(buf, dest=1)], tmo, "ping-pong send", comm)
                wait_all([comm.Irecv(buf, source=1)], tmo, "ping-pong receive", comm)
            elif rank == 1:
                wait_all([comm.Irecv(buf, source=0)], tmo, "ping-pong receive", comm)
                wait_all([comm.Isend(buf, dest=0)], tmo, "ping-pong send", comm)
        alpha = bcast_object(comm, (time.perf_counter() - t0) / 40 if rank == 0 else None, 0, tmo)

    barrier(comm, tmo)
    if rank == 0:
        def ser_step() -> None:
            serial.zero_grad()
            xx = x.clone().requires_grad_(True)
            serial(xx).square().sum().backward()

        ser_step()
        t0 = time.perf_counter()
        for _ in range(args.reps):
            ser_step()
        t_ser = (time.perf_counter() - t0) / args.reps
        # cost of one forward step and one adjoint step (vjp) of one layer, for the model
        layer = serial[0]
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(50):
                layer(x)
        c_f = (time.perf_counter() - t0) / 50
        xx = x.clone().requires_grad_(True)
        t0 = time.perf_counter()
        for _ in range(50):
            y = layer(xx)
            torch.autograd.grad(y, xx, torch.ones_like(y))
        c_b = (time.perf_counter() - t0) / 50
        print(RESULT + json.dumps(dict(
            steps=args.steps, ranks=size, levels=fwd.levels, cfactor=args.cfactor, fwd_iters=fwd.iterations,
            bwd_iters=bwd.iterations, fwd_res=fwd.residuals[-1], bwd_res=bwd.residuals[-1],
            crit_fwd=fwd.critical_path, crit_bwd=bwd.critical_path, crit=crit, total=total_steps,
            serial_steps=2 * args.steps, t_par=t_par, t_ser=t_ser, c_f=c_f, c_b=c_b, alpha=alpha)),
            flush=True)
    barrier(comm, tmo)


# ----------------------------------------------------------------------------- model
def model_critical_path(n: int, p: int, levels: int, m: int, sweeps: int, iters: int) -> tuple[float, float]:
    """Step evaluations and messages on the critical path of ``iters`` V-cycles (no nested iteration)
    over n points on p ranks, counted analytically for the cycle of torchhpc.braid.mgrit.

    Per level, an F-relaxation costs the local share of F-points, but at least the m-1 steps of one
    interval once intervals span ranks; C-work costs the local share of C-points; the coarsest grid
    is one sequential pipeline.  Exact at one rank; an estimate (no waiting between levels) beyond.
    """
    sizes = [n]
    while len(sizes) < levels and (sizes[-1] - 1) // m + 1 >= 2:
        sizes.append((sizes[-1] - 1) // m + 1)
    if len(sizes) == 1:
        return float(n - 1), float(p - 1)
    steps, msgs = 0.0, 0.0
    for it in range(iters):
        for lvl, npts in enumerate(sizes[:-1]):
            nf, nc = npts - sizes[lvl + 1], sizes[lvl + 1] - 1
            f = float(nf) if p == 1 else max(math.ceil(nf / p), min(m - 1, nf))
            c = float(max(math.ceil(nc / p), 1))
            first_f = lvl > 0 or it == 0
            cached = lvl == 0 and it > 0  # the residual's steps serve the first C-relaxation
            steps += (f if first_f else 0) + sweeps * (c + f) - (c if cached and sweeps else 0) + 2 * c + f
            msgs += (1 if first_f else 0) + 2 * sweeps + 3
            if lvl == 0:
                steps += c  # residual
                msgs += 1
        steps += sizes[-1] - 1
        msgs += min(p, sizes[-1]) - 1
    return steps, msgs


def predict(rows: list[dict], out_png: Path) -> list[tuple]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = max((r for r in rows if r["ranks"] > 1), key=lambda r: r["steps"], default=rows[-1])
    c_f, c_b, alpha = ref["c_f"], ref["c_b"], max(ref["alpha"], 1e-6)
    its_f, its_b, m, levels = ref["fwd_iters"], ref["bwd_iters"], ref["cfactor"], ref["levels"]
    ranks = [16, 32, 64, 128, 256, 512, 1024]
    table = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for n, lv in ((1024, levels), (4096, levels), (16384, levels), (16384, 30)):
        ps = [p for p in ranks if p <= n]
        speed = []
        for p in ps:
            sf, mf = model_critical_path(n + 1, p, lv, m, 1, its_f)
            sb, mb = model_critical_path(n + 1, p, lv, m, 1, its_b)
            t_par = sf * c_f + sb * c_b + math.ceil(n / p) * c_b + (mf + mb) * alpha
            s = n * (c_f + c_b) / t_par
            speed.append(s)
            table.append((f"{n}" if lv == levels else f"{n}, all levels", p, s))
        ax.plot(ps, speed, marker="o", linestyle="-" if lv == levels else "--",
                label=f"N = {n} layers" + ("" if lv == levels else ", levels down to 2 points"))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("predicted speedup over serial")
    ax.set_title(f"MODEL (not measured): {levels} levels, cfactor {m}, {its_f}+{its_b} iterations,\n"
                 f"step {c_f * 1e3:.2f} ms, adjoint {c_b * 1e3:.2f} ms, message {alpha * 1e6:.0f} us "
                 "(measured)",
                 fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    return table


# ----------------------------------------------------------------------------- engines (under mpiexec)
def engine_worker(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    from torchhpc.braid import solve
    from torchhpc.braid.transport import allreduce, barrier, default_timeout

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    tmo = default_timeout()
    gen = torch.Generator().manual_seed(0)
    if args.problem == "conv":  # forward Euler on a ResNet-like conv step: real work per step
        conv = torch.nn.Conv2d(args.channels, args.channels, 3, padding=1)
        u0 = torch.randn(args.batch, args.channels, 8, 8, generator=gen)

        def step(u, t0, t1):
            return u + (t1 - t0) * torch.tanh(conv(u))
    else:  # a linear ODE on 16 values: almost no work per step, so the per-call overheads show
        a = -torch.rand(16, generator=gen, dtype=torch.float64)
        u0 = torch.ones(16, dtype=torch.float64)

        def step(u, t0, t1):
            return u / (1 - (t1 - t0) * a)
    t = [i / args.steps for i in range(args.steps + 1)]
    opts = dict(max_levels=args.levels, cfactor=args.cfactor, relax="FCF", tol=0.0, max_iter=args.iters,
                nested_iteration=False)
    per_iter: dict[str, list[float]] = {"python": [], "xbraid": []}
    steps: dict[str, float] = {}
    with torch.no_grad():
        for rnd in range(args.rounds + 1):  # round 0 warms up
            order = ["python", "xbraid"] if rnd % 2 else ["xbraid", "python"]
            for engine in order:
                barrier(comm, tmo)
                t0 = time.perf_counter()
                res = solve(step, u0, t, comm, engine=engine, **opts)
                wall = allreduce(comm, time.perf_counter() - t0, "max", tmo)
                if rnd:
                    per_iter[engine].append(wall / res.iterations)
                    steps[engine] = allreduce(comm, res.steps, "sum", tmo) / res.iterations
    if comm.Get_rank() == 0:
        print(RESULT + json.dumps(dict(problem=args.problem, steps=args.steps, ranks=comm.Get_size(),
                                       levels=res.levels, iters=res.iterations, steps_per_iter=steps,
                                       **per_iter)), flush=True)


def engines_main(args: argparse.Namespace, env: dict) -> None:
    """Table of XBraid vs Python engine wall time per MGRIT iteration, per problem and rank count."""
    import statistics

    print(f"mgrit.solve wall time per MGRIT iteration: {args.steps} steps, {args.levels} levels, cfactor "
          f"{args.cfactor}, FCF, {args.iters} cycles per solve, {args.rounds} rounds (median, range over rounds)")
    print("| problem | ranks | levels | steps/iter python, xbraid | python ms/iter | xbraid ms/iter | "
          "xbraid / python (range) |")
    print("|---|---|---|---|---|---|---|")
    from torchhpc.runtime.mpirun import available_cores, local_job_env, mpiexec_argv

    for problem in args.problems:
        for p in args.ranks:
            cmd = mpiexec_argv(p, [sys.executable, __file__, "--engine-worker", "--problem", problem, "--steps",
                                   str(args.steps), "--levels", str(args.levels), "--cfactor", str(args.cfactor),
                                   "--iters", str(args.iters), "--rounds", str(args.rounds), "--channels",
                                   str(args.channels), "--batch", str(args.batch)])
            out = subprocess.run(cmd, env=local_job_env(env, oversubscribed=p > available_cores()),
                                 capture_output=True, text=True, timeout=900)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)), None)
            if out.returncode != 0 or line is None:
                sys.exit(f"worker failed ({' '.join(cmd)}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            r = json.loads(line[len(RESULT):])
            ratios = [x / y for x, y in zip(r["xbraid"], r["python"], strict=True)]
            spi = r["steps_per_iter"]
            print(f"| {problem} | {p} | {r['levels']} | {spi['python']:.0f}, {spi['xbraid']:.0f} | "
                  f"{statistics.median(r['python']) * 1e3:.2f} | "
                  f"{statistics.median(r['xbraid']) * 1e3:.2f} | {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) |", flush=True)


# ----------------------------------------------------------------------------- driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 steps at 1 and 2 ranks, one repetition")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--depths", type=int, nargs="*", default=[32, 128, 256])
    ap.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--levels", type=int, default=3)
    ap.add_argument("--cfactor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--tol", type=float, default=1e-8)
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--png", type=Path, default=Path("bench/braid_speedup_model.png"))
    ap.add_argument("--engines", action="store_true", help="XBraid engine vs Python engine, per MGRIT iteration")
    ap.add_argument("--problems", nargs="*", default=["tiny", "conv"], choices=["tiny", "conv"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--problem", default="tiny", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.engine_worker:
        engine_worker(args)
        return
    if args.engines and args.steps == 32:
        args.steps = 256
    if args.quick:
        args.depths, args.ranks, args.reps = [32], [1, 2], 1

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from torchhpc.runtime.mpirun import available_cores, local_job_env, mpiexec_argv

    env = local_job_env(oversubscribed=False)  # (yield-when-idle is added per launch, only when oversubscribed)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1] / "src"),
                                                    env.get("PYTHONPATH")) if p)
    if args.engines:
        engines_main(args, env)
        return
    rows = []
    for n in args.depths:
        for p in args.ranks:
            cmd = mpiexec_argv(p, [sys.executable, __file__, "--worker", "--steps", str(n), "--levels",
                                   str(args.levels), "--cfactor", str(args.cfactor), "--iters",
                                   str(args.iters), "--tol", str(args.tol), "--channels",
                                   str(args.channels), "--batch", str(args.batch), "--reps", str(args.reps)])
            out = subprocess.run(cmd, env=local_job_env(env, oversubscribed=p > available_cores()),
                                 capture_output=True, text=True, timeout=900)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)), None)
            if out.returncode != 0 or line is None:
                sys.exit(f"worker failed ({' '.join(cmd)}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            rows.append(json.loads(line[len(RESULT):]))

    print(f"LayerParallel ResNet forward+backward: {args.levels} levels, cfactor {args.cfactor}, "
          f"max {args.iters} MGRIT iterations, conv {args.channels}ch 8x8, batch {args.batch}")
    print("| steps | ranks | iters fwd/bwd | critical path (model) | total steps | serial steps | "
          "critical/serial | wall par / serial |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        shape = (r["steps"] + 1, r["ranks"], r["levels"], r["cfactor"], 1)
        model = (model_critical_path(*shape, r["fwd_iters"])[0]
                 + model_critical_path(*shape, r["bwd_iters"])[0] + math.ceil(r["steps"] / r["ranks"]))
        print(f"| {r['steps']} | {r['ranks']} | {r['fwd_iters']}/{r['bwd_iters']} | "
              f"{r['crit']} ({model:.0f}) | {r['total']} | {r['serial_steps']} | "
              f"{r['crit'] / r['serial_steps']:.2f} | "
              f"{r['t_par'] * 1e3:.1f} ms / {r['t_ser'] * 1e3:.1f} ms = {r['t_par'] / r['t_ser']:.2f} |")
    table = predict(rows, args.png)
    ref = max((r for r in rows if r["ranks"] > 1), key=lambda r: r["steps"], default=rows[-1])
    print(f"\nmeasured costs ({ref['steps']} steps, {ref['ranks']} ranks): step {ref['c_f'] * 1e3:.2f} ms, "
          f"adjoint step {ref['c_b'] * 1e3:.2f} ms, message {ref['alpha'] * 1e6:.0f} us")
    print(f"MODEL (not a measurement) of speedup over serial, written to {args.png}:")
    print("| layers | " + " | ".join(str(p) for p in sorted({p for _, p, _ in table})) + " ranks |")
    by_n: dict[str, dict[int, float]] = {}
    for n, p, s in table:
        by_n.setdefault(n, {})[p] = s
    ps = sorted({p for _, p, _ in table})
    print("|---|" + "---|" * len(ps))
    for n, d in by_n.items():
        print(f"| {n} | " + " | ".join(f"{d[p]:.1f}" if p in d else "-" for p in ps) + " |")


if __name__ == "__main__":
    main()
