"""``torchhpc bench``: nccl-tests-style collective benchmark, accl vs upstream's MPI backend vs gloo vs raw MPI.

Usage::

    torchhpc bench all --np 2 --json bench-2.json --plot busbw-2.png   # the five collectives, 8 B - 64 MiB
    torchhpc bench allreduce --np 4 --quick                             # three sizes, seconds
    torchhpc bench --from-json bench-2.json bench-4.json --plot busbw.svg   # tables and plot again, no MPI
    torchhpc bench --plan --np 4                                        # accl's path per call, no MPI job
    mpiexec -n 2 python -m torchhpc bench all    # already under mpiexec: runs in place

Outside an MPI job the command starts itself under ``mpiexec -n NP`` (``--oversubscribe`` and yield-when-idle
only for more ranks than cores; one thread per rank).  For every size it times the same float32 collective as:

* ``accl``: ``torch.distributed`` on the ``accl`` backend (the default group);
* ``mpi-upstream``: ``torch.distributed`` on PyTorch's own ``ProcessGroupMPI`` built against the wheel by
  ``make mpi-backend`` (:mod:`torchhpc.mpi_upstream`, a group of every rank); skipped, with one line, where
  that module is not built or not loadable;
* ``gloo``: ``torch.distributed`` on a gloo group of every rank;
* ``mpi4py``: the raw MPI call a user would write (``comm.Allreduce(MPI.IN_PLACE, buf)``, ``Bcast``,
  ``Allgather``, ``Reduce_scatter_block``, ``Alltoall``) on torch-allocated memory (``torch.zeros``, handed to
  mpi4py as ``tensor.numpy()``, the same storage: checked by address), labelled ``mpi(torch mem)``;
* ``mpi4py-numpy`` (``--impls`` only): the same raw call on numpy-allocated arrays.  numpy advises transparent
  huge pages for large arrays, torch's allocator does not unless ``THP_MEM_ALLOC_ENABLE=1``, so the two raw
  columns differ at large sizes where THP is ``madvise``.

all_gather and reduce_scatter go through ``all_gather_into_tensor``/``reduce_scatter_tensor`` (torch >= 2.13:
``all_gather_single``/``reduce_scatter_single``), all_to_all through ``all_to_all_single``.  A size is the
buffer every rank passes: all_gather's output, reduce_scatter's and all_to_all's input.

Timing (:mod:`.timing`) is robust to a noisy, shared machine: each (size, implementation) is timed in
``--repeats`` interleaved rounds (round 1 times every implementation once, round 2 again, starting one further
along the list...); a round's time is the slowest rank's mean over as many calls as fit ``--time-per-point /
--repeats`` seconds (at least 5, at most 2000, after warm-up calls).  The table (:mod:`.report`) shows the
median round and the spread (max - min) / median of the rounds; algbw = size / time, busbw = algbw x the
nccl-tests factor.  ``--plot`` (:mod:`.plot`) needs matplotlib.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone

from . import runners, timing
from .plot import PlotUnavailableError, write_plot
from .report import human, legend, print_table
from .results import COLLECTIVES, DEFAULT_IMPLS, IMPLS, JSON_FORMAT, LABELS, Point, read_json, write_json

__all__ = ["main", "run", "FULL_SIZES", "QUICK_SIZES"]

FULL_SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [8, 4 << 10, 1 << 20]
PLOT_FORMATS = (".png", ".svg", ".pdf")


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="torchhpc bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("collective", nargs="?", default=None, choices=COLLECTIVES + ("all",),
                    help="default: allreduce (with --from-json: all)")
    ap.add_argument("--np", type=int, default=2, help="ranks to launch when not already under mpiexec")
    ap.add_argument("--quick", action="store_true", help="three sizes, one round (seconds)")
    ap.add_argument("--min-bytes", type=int, default=None)
    ap.add_argument("--max-bytes", type=int, default=None)
    ap.add_argument("--time-per-point", type=float, default=0.25,
                    help="seconds spent per size and impl, all rounds together (at least 5 calls a round)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="interleaved timing rounds per size; the table shows the median round")
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every measured point here")
    ap.add_argument("--plot", default=None, metavar="PATH", help="draw busbw vs size here (.png, .svg or .pdf; "
                    "needs matplotlib)")
    ap.add_argument("--plot-title", default="", metavar="TEXT",
                    help="a title above the plot: what the run was (the machine, the link's rate)")
    ap.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                    help="no run: print the tables (and --plot) of these --json files")
    ap.add_argument("--plan", action="store_true", help="no run: the path accl takes for each collective and size "
                    "at --np ranks, on one node and across nodes (TORCHHPC_ACCL_* apply)")
    return ap.parse_args(argv)


def _refusal(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot run (None when they can)."""
    if args.np < 1:
        return "--np must be >= 1"
    if args.repeats < 1:
        return "--repeats must be >= 1"
    if args.plot and not args.plot.endswith(PLOT_FORMATS):
        return f"--plot writes {', '.join(PLOT_FORMATS)}: give a path ending in one of them"
    unknown = [i for i in args.impls.split(",") if i not in IMPLS]
    if unknown:
        return f"unknown --impls {','.join(unknown)} (known: {','.join(IMPLS)})"
    # checked before anything runs, on every rank: rank 0 failing to write at the end would leave the others
    # waiting for it in the teardown's collectives
    for opt, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            return f"{opt} {path}: directory {os.path.dirname(os.path.abspath(path))} does not exist"
    return None


def _relaunch(argv: list[str], nprocs: int) -> int:
    from torchhpc.runtime.mpirun import available_cores, local_job_env, mpiexec_argv

    # Open MPI's yield-when-idle only where ranks share cores: it slows large blocking calls otherwise
    env = local_job_env(oversubscribed=nprocs > available_cores())
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    cmd = mpiexec_argv(nprocs, [sys.executable, "-m", "torchhpc.bench", *argv])
    return subprocess.call(cmd, env=env)


def _sizes(args: argparse.Namespace) -> list[int]:
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    lo = args.min_bytes or 0
    hi = args.max_bytes or (1 << 62)
    return [s for s in sizes if lo <= s <= hi]


def _thp_state() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        thp = "?"
    return f"THP {thp}, THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}"


def _meta(args: argparse.Namespace, n: int, impls: list[str], skipped: dict[str, str], repeats: int) -> dict:
    import torch
    from mpi4py import MPI

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"format": JSON_FORMAT, "ranks": n, "dtype": "float32", "impls": impls, "skipped": skipped,
            "labels": {i: LABELS[i] for i in impls}, "repeats": repeats, "time_per_point_s": args.time_per_point,
            "quick": args.quick, "spread": "(max - min) / median of the round means",
            "round": "slowest rank's mean seconds per call", "torch": torch.__version__,
            "mpi": " ".join(MPI.Get_library_version().replace("\0", "").split(",")[0].split()), "host": platform.node(),
            "cpus": os.cpu_count(), "memory": _thp_state(), "commit": commit,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _time_size(coll: str, size: int, n: int, groups: dict, comm, impls: list[str], repeats: int,
               budget: float, quick: bool) -> list[Point]:
    """One point per implementation for one ``coll`` of ``size`` bytes, in ``repeats`` interleaved rounds."""
    fns = runners.runners(coll, size, n, groups, comm, impls)
    rounds = timing.interleaved(fns, repeats, lambda fn: timing.mean_call_time(fn, comm, budget, quick))
    runners.settle(groups)
    del fns
    return [Point(coll, n, size, impl, rounds[impl]) for impl in impls]


def _time_collective(coll: str, args: argparse.Namespace, n: int, groups: dict, comm, impls: list[str],
                     repeats: int) -> list[Point]:
    """Every size of one collective timed (see :func:`_time_size`); rank 0 prints its table and duration."""
    t_coll = time.perf_counter()
    budget = args.time_per_point / repeats
    rows: list[Point] = []
    for size in dict.fromkeys(runners.measured_bytes(coll, s, n) for s in _sizes(args)):
        rows += _time_size(coll, size, n, groups, comm, impls, repeats, budget, args.quick)
    if comm.Get_rank() == 0:
        print_table(rows, impls, repeats)
        print(f"# {coll}: {time.perf_counter() - t_coll:.0f} s", flush=True)
    return rows


def _write_outputs(args: argparse.Namespace, meta: dict, points: list[Point], impls: list[str]) -> None:
    """Write the ``--json`` and ``--plot`` files asked for (rank 0 only), saying so."""
    if args.json:
        write_json(args.json, meta, points)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            write_plot(args.plot, points, impls, args.plot_title)
            print(f"wrote {args.plot}")
        except PlotUnavailableError as exc:
            print(exc, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Benchmark body, executed by every rank of an MPI job."""
    import torch.distributed as dist
    from mpi4py import MPI

    import torchhpc.accl as accl

    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    dist.init_process_group("accl", pg_options=accl.AcclOptions())
    impls = [i for i in dict.fromkeys(args.impls.split(",")) if i in IMPLS]
    groups, skipped = runners.setup_groups(comm, impls, say)
    if not impls:
        say("torchhpc bench: no implementation left to time", flush=True)
        runners.teardown(groups, comm)
        return 1
    colls = COLLECTIVES if args.collective == "all" else (args.collective or "allreduce",)
    repeats = 1 if args.quick else args.repeats
    meta = _meta(args, n, impls, skipped, repeats) if rank == 0 else {}
    say(f"# torchhpc bench: {n} ranks, {meta.get('mpi')}, torch {meta.get('torch')}, {meta.get('memory')}",
        flush=True)
    say(legend(repeats), flush=True)
    points: list[Point] = []
    start = time.perf_counter()
    for coll in colls:
        points += _time_collective(coll, args, n, groups, comm, impls, repeats)
    say(f"\n# total {time.perf_counter() - start:.0f} s for {len(colls)} collective(s) at {n} ranks", flush=True)
    if rank == 0:
        _write_outputs(args, meta, points, impls)
    runners.settle(groups)
    runners.teardown(groups, comm)
    return 0


def _replay(args: argparse.Namespace) -> int:
    metas, points = read_json(args.from_json)
    if args.collective not in (None, "all"):
        points = [p for p in points if p.collective == args.collective]
    impls = list(dict.fromkeys(i for m in metas for i in m["impls"]))
    for m in metas:
        print(f"# {m['ranks']} ranks: {m['mpi']}, torch {m['torch']}, {m['memory']}, {m['host']} "
              f"({m['cpus']} cpus), commit {m['commit'] or '?'}, {m['date']}")
        for impl, why in m.get("skipped", {}).items():
            print(f"#   {impl} skipped: {why}")
    print(legend(max((len(p.rounds_s) for p in points), default=0)))
    for key in sorted({(p.ranks, COLLECTIVES.index(p.collective)) for p in points}):
        rows = [p for p in points if (p.ranks, COLLECTIVES.index(p.collective)) == key]
        print_table(rows, impls, max(len(p.rounds_s) for p in rows))
    if args.plot:
        try:
            write_plot(args.plot, points, impls, args.plot_title)
        except PlotUnavailableError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"wrote {args.plot}")
    return 0


#: the benchmark's collectives by the names accl's plan knows (the calls the benchmark makes)
PLAN_NAMES = {"allreduce": "all_reduce", "broadcast": "broadcast", "allgather": "_all_gather_base",
              "reduce_scatter": "_reduce_scatter_base", "alltoall": "all_to_all_single"}


def _print_plan(args: argparse.Namespace) -> int:
    """accl's path for each collective and size at ``--np`` ranks: one node / across nodes."""
    from torchhpc.accl.options import AcclOptions, plan

    opts = AcclOptions()
    colls = COLLECTIVES if args.collective in (None, "all") else (args.collective,)
    print(f"# accl's path per call at {args.np} ranks, one node / across nodes (docs/accl.md, 'How accl chooses')")
    print("#     size | " + " | ".join(f"{c:>25}" for c in colls))
    for size in _sizes(args):
        cells = [" / ".join(plan(PLAN_NAMES[c], size, args.np, spans, opts) for spans in (False, True))
                 for c in colls]
        print(f"{human(size):>10} | " + " | ".join(f"{c:>25}" for c in cells))
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``torchhpc bench``: relaunch under mpiexec unless already inside an MPI job."""
    from torchhpc.accl.rendezvous import under_mpi_launcher

    args = _parse(list(argv))
    refusal = _refusal(args)
    if refusal:
        print(f"torchhpc bench: {refusal}", file=sys.stderr)
        return 2
    if args.from_json:
        return _replay(args)
    if args.plan:
        return _print_plan(args)
    if not under_mpi_launcher():
        return _relaunch(list(argv), args.np)
    return run(args)
