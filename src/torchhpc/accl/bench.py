"""``torchhpc bench``: nccl-tests-style collective benchmark, accl vs gloo vs raw mpi4py in one run.

Usage::

    torchhpc bench allreduce [--np 2] [--quick] [--plot busbw.png]
    torchhpc bench all --np 2                 # allreduce, broadcast, allgather, reduce_scatter, alltoall
    mpiexec -n 2 python bench/allreduce.py allreduce   # already under mpiexec: runs in place

Outside an MPI job the command starts itself under ``mpiexec -n NP`` (oversubscribed, one thread per
rank).  For every size it times the same float32 collective through ``torch.distributed`` with the
``accl`` backend, through ``torch.distributed`` with ``gloo``, and as the plain mpi4py call a user
would write on numpy buffers (``comm.Allreduce(MPI.IN_PLACE, buf)``...).  all_gather and
reduce_scatter go through ``all_gather_into_tensor``/``reduce_scatter_tensor`` (torch >= 2.13:
their new names ``all_gather_single``/``reduce_scatter_single``), all_to_all through
``all_to_all_single``.

Timing is robust to a noisy, shared machine: each (size, implementation) is timed in ``--repeats``
interleaved rounds (round 1 times accl, gloo, mpi4py, round 2 again...), each round's time is the
slowest rank's mean over its iterations, and the table reports the median of the round means.
algbw = size / time, busbw = algbw x the nccl-tests factor of the collective.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = ["main", "COLLECTIVES", "bus_factor", "mean_call_time"]

COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall")
FULL_SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [8, 4 << 10, 1 << 20]
IMPLS = ("accl", "accl-py", "gloo", "mpi4py")  # accl-py: accl with AcclOptions(front=False), the adapter alone


def bus_factor(coll: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: what each rank's link carries relative to the buffer size."""
    if coll == "allreduce":
        return 2.0 * (n - 1) / n
    if coll in ("allgather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="torchhpc bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("collective", nargs="?", default="allreduce", choices=COLLECTIVES + ("all",))
    ap.add_argument("--np", type=int, default=2, help="ranks to launch when not already under mpiexec")
    ap.add_argument("--quick", action="store_true", help="three sizes, few iterations (seconds)")
    ap.add_argument("--min-bytes", type=int, default=None)
    ap.add_argument("--max-bytes", type=int, default=None)
    ap.add_argument("--time-per-point", type=float, default=0.25,
                    help="seconds spent per size and impl, all rounds together")
    ap.add_argument("--repeats", type=int, default=5,
                    help="interleaved timing rounds per size; the table shows the median round")
    ap.add_argument("--plot", default=None, help="write a PNG of busbw vs size here")
    ap.add_argument("--no-check", action="store_true", help="accl without the cross-rank header check")
    ap.add_argument("--impls", default="accl,gloo,mpi4py",
                    help="subset of accl,accl-py,gloo,mpi4py (accl-py: accl without its C++ front)")
    return ap.parse_args(argv)


def _under_mpi() -> bool:
    from .rendezvous import under_mpi_launcher

    return under_mpi_launcher()


def _relaunch(argv: list[str], nprocs: int) -> int:
    from torchhpc.mpirun import available_cores, local_job_env, mpiexec_argv

    # Open MPI's yield-when-idle only where ranks share cores: it slows large blocking calls otherwise
    env = local_job_env(oversubscribed=nprocs > available_cores())
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    cmd = mpiexec_argv(nprocs, [sys.executable, "-m", "torchhpc.accl.bench", *argv])
    return subprocess.call(cmd, env=env)


def _sizes(args: argparse.Namespace) -> list[int]:
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    lo = args.min_bytes or 0
    hi = args.max_bytes or (1 << 62)
    return [s for s in sizes if lo <= s <= hi]


def _runners(coll: str, nbytes: int, n: int, groups: dict, comm, impls: list[str]) -> dict[str, Callable[[], None]]:
    """One callable per implementation in ``impls`` doing one ``coll`` of ``nbytes`` (float32)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    numel = max(1, nbytes // 4)
    per = max(1, numel // n)
    out: dict[str, Callable[[], None]] = {}
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch >= 2.13 name
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    # (input, output) element counts; all_gather's size is its output buffer, reduce_scatter's and
    # all_to_all's their input buffer
    shapes = {"allreduce": (numel, 0), "broadcast": (numel, 0), "allgather": (per, per * n),
              "reduce_scatter": (per * n, per), "alltoall": (per * n, per * n)}
    n_in, n_out = shapes[coll]
    for impl in impls:  # every implementation its own buffers
        ins, outs = torch.ones(n_in), torch.empty(n_out)
        if impl == "mpi4py":
            a, b = ins.numpy(), outs.numpy()
            out[impl] = {"allreduce": lambda a=a: comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM),
                         "broadcast": lambda a=a: comm.Bcast(a, 0),
                         "allgather": lambda a=a, b=b: comm.Allgather(a, b),
                         "reduce_scatter": lambda a=a, b=b: comm.Reduce_scatter_block(a, b, MPI.SUM),
                         "alltoall": lambda a=a, b=b: comm.Alltoall(a, b)}[coll]
            continue
        g = groups.get(impl)
        out[impl] = {"allreduce": lambda t=ins, g=g: dist.all_reduce(t, group=g),
                     "broadcast": lambda t=ins, g=g: dist.broadcast(t, 0, group=g),
                     "allgather": lambda i=ins, o=outs, g=g: all_gather(o, i, group=g),
                     "reduce_scatter": lambda i=ins, o=outs, g=g: reduce_scatter(o, i, group=g),
                     "alltoall": lambda i=ins, o=outs, g=g: dist.all_to_all_single(o, i, group=g)}[coll]
    return out


def mean_call_time(fn: Callable[[], None], comm, budget_s: float, quick: bool = False,
                   max_iters: int = 2000) -> float:
    """Mean seconds per call of ``fn`` on the slowest rank of ``comm``, over as many calls as fit ``budget_s``
    (at most ``max_iters``); the iteration count is agreed across ranks, so collectives stay matched."""
    from mpi4py import MPI

    fn()
    fn()
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    one = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    iters = int(max(3 if quick else 5, min(max_iters, budget_s / max(one, 1e-7))))
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = (time.perf_counter() - t0) / iters
    return comm.allreduce(elapsed, op=MPI.MAX)


def _human(nbytes: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes / div:g} {unit}"
    return f"{nbytes} B"


def run(args: argparse.Namespace) -> int:
    """Benchmark body, executed by every rank of an MPI job."""
    import torch.distributed as dist
    from mpi4py import MPI

    import torchhpc.accl as accl

    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()
    opts = accl.AcclOptions(check=not args.no_check)
    dist.init_process_group("accl", pg_options=opts)
    impls = [i for i in args.impls.split(",") if i in IMPLS]
    groups = {"accl": dist.group.WORLD}  # (every rank parses the same --impls: the groups match)
    if "gloo" in impls:
        groups["gloo"] = dist.new_group(backend="gloo")
    if "accl-py" in impls:
        groups["accl-py"] = dist.new_group(backend="accl", pg_options=accl.AcclOptions(check=not args.no_check,
                                                                                       front=False))
    colls = COLLECTIVES if args.collective == "all" else (args.collective,)
    results: dict[str, list[tuple[int, dict[str, float]]]] = {}
    for coll in colls:
        rows = []
        repeats = 1 if args.quick else args.repeats
        budget = args.time_per_point / repeats
        for size in _sizes(args):
            runners = _runners(coll, size, n, groups, comm, impls)
            rounds: dict[str, list[float]] = {impl: [] for impl in impls}
            for _ in range(repeats):  # interleaved: slow phases of a shared machine hit every impl
                for impl in impls:
                    rounds[impl].append(mean_call_time(runners[impl], comm, budget, args.quick))
            # accl's ratio to raw mpi4py round by round (the rounds are paired in time): its spread
            paired = ([m / a for a, m in zip(rounds["accl"], rounds["mpi4py"], strict=True)]
                      if "accl" in rounds and "mpi4py" in rounds else [])
            rows.append((size, {impl: statistics.median(ts) for impl, ts in rounds.items()}, paired))
        results[coll] = rows
        if rank == 0:
            _print_table(coll, rows, impls, n)
    if rank == 0 and args.plot:
        _plot(results, impls, n, args.plot)
    dist.destroy_process_group()
    comm.Free()
    return 0


def _print_table(coll: str, rows: list, impls: list[str], n: int) -> None:
    fac = bus_factor(coll, n)
    print(f"\n# {coll}, float32, {n} ranks; time in us (median of interleaved rounds' means), "
          f"bandwidths in GB/s (busbw factor {fac:.3g})")
    head = f"{'size':>10}"
    for impl in impls:
        head += f" | {impl + ' time':>12} {'algbw':>7} {'busbw':>7}"
    if "accl" in impls and "gloo" in impls:
        head += f" | {'vs gloo':>7}"
    if "accl" in impls and "mpi4py" in impls:
        head += f" | {'vs mpi4py':>9} {'rounds min-max':>14} {'+us':>7}"
    print(head)
    for size, times, paired in rows:
        line = f"{_human(size):>10}"
        for impl in impls:
            t = times[impl]
            alg = size / t / 1e9
            line += f" | {t * 1e6:12.1f} {alg:7.3f} {alg * fac:7.3f}"
        if "accl" in impls and "gloo" in impls:
            line += f" | {times['gloo'] / times['accl']:6.2f}x"
        if "accl" in impls and "mpi4py" in impls:
            extra_us = (times["accl"] - times["mpi4py"]) * 1e6
            spread = f"{min(paired):.2f}-{max(paired):.2f}x" if paired else "-"
            line += f" | {times['mpi4py'] / times['accl']:8.2f}x {spread:>14} {extra_us:7.1f}"
        print(line, flush=True)


def _plot(results: dict, impls: list[str], n: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (coll, rows) in zip(axes[0], results.items(), strict=True):
        fac = bus_factor(coll, n)
        sizes = [s for s, _, _ in rows]
        for impl in impls:
            ax.plot(sizes, [s / t[impl] / 1e9 * fac for s, t, _ in rows], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{coll}, {n} ranks")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str]) -> int:
    """Entry point of ``torchhpc bench``: relaunch under mpiexec unless already inside an MPI job."""
    args = _parse(list(argv))
    if args.np < 1:
        print("torchhpc bench: --np must be >= 1", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print("torchhpc bench: --repeats must be >= 1", file=sys.stderr)
        return 2
    if not _under_mpi():
        return _relaunch(list(argv), args.np)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
