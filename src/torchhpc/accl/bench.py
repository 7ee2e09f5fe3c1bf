"""``torchhpc bench``: nccl-tests-style collective benchmark, accl vs upstream's MPI backend vs gloo vs raw MPI.

Usage::

    torchhpc bench all --np 2 --json bench-2.json --plot busbw-2.svg   # the five collectives, 8 B - 64 MiB
    torchhpc bench allreduce --np 4 --quick                             # three sizes, seconds
    torchhpc bench --from-json bench-2.json bench-4.json --plot busbw.svg   # tables and plot again, no MPI
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

Timing is robust to a noisy, shared machine: each (size, implementation) is timed in ``--repeats`` interleaved
rounds (round 1 times every implementation once, round 2 again, starting one further along the list...); a
round's time is the slowest rank's mean over as many calls as fit ``--time-per-point / --repeats`` seconds
(at least 5, at most 2000, after 3 warm-up calls).  The table shows the median round and the spread
(max - min) / median of the rounds; algbw = size / time, busbw = algbw x the nccl-tests factor.

Targets checked per row (column ``targets``): below 1 MiB accl's time <= raw + 2 us; from 1 MiB accl's busbw
>= 0.95 x raw's; at every size accl faster than mpi-upstream.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from xml.sax.saxutils import escape

__all__ = ["main", "COLLECTIVES", "IMPLS", "DEFAULT_IMPLS", "LABELS", "Point", "bus_factor", "measured_bytes",
           "mean_call_time", "print_table", "write_json", "read_json", "write_svg"]

COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall")
FULL_SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [8, 4 << 10, 1 << 20]
IMPLS = ("accl", "mpi-upstream", "gloo", "mpi4py", "mpi4py-numpy")
DEFAULT_IMPLS = ("accl", "mpi-upstream", "gloo", "mpi4py")
LABELS = {"accl": "accl", "mpi-upstream": "mpi-upstream", "gloo": "gloo",
          "mpi4py": "mpi(torch mem)", "mpi4py-numpy": "mpi(numpy mem)"}
RAW = "mpi4py"  # the baseline of the ratios
SMALL_BELOW = 1 << 20  # sizes below: the "+2 us over raw" target; from here: the 0.95x bandwidth target
TARGET_EXTRA_US = 2.0
TARGET_BW_RATIO = 0.95
JSON_FORMAT = "torchhpc-bench/1"


@dataclass
class Point:
    """One measured (collective, ranks, size, implementation): each round's mean seconds per call."""

    collective: str
    ranks: int
    size: int
    impl: str
    rounds_s: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        """The median of the round means (seconds)."""
        return statistics.median(self.rounds_s)

    @property
    def spread(self) -> float:
        """(max - min) / median of the round means."""
        return (max(self.rounds_s) - min(self.rounds_s)) / self.median_s

    def busbw(self) -> float:
        """Bus bandwidth in GB/s (nccl-tests' definition)."""
        return self.size / self.median_s / 1e9 * bus_factor(self.collective, self.ranks)


def bus_factor(coll: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: what each rank's link carries relative to the buffer size."""
    if coll == "allreduce":
        return 2.0 * (n - 1) / n
    if coll in ("allgather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="torchhpc bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("collective", nargs="?", default=None, choices=COLLECTIVES + ("all",),
                    help="default: allreduce (with --from-json: all)")
    ap.add_argument("--np", type=int, default=2, help="ranks to launch when not already under mpiexec")
    ap.add_argument("--quick", action="store_true", help="three sizes, one round (seconds)")
    ap.add_argument("--min-bytes", type=int, default=None)
    ap.add_argument("--max-bytes", type=int, default=None)
    ap.add_argument("--time-per-point", type=float, default=0.25,
                    help="seconds spent per size and impl, all rounds together (at least 8 calls a round)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="interleaved timing rounds per size; the table shows the median round")
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every measured point here")
    ap.add_argument("--plot", default=None, metavar="PATH.svg", help="write an SVG of busbw vs size here")
    ap.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                    help="no run: print the tables (and --plot) of these --json files")
    ap.add_argument("--no-check", action="store_true", help="accl without the cross-rank header check")
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


def _raw_buffers(impl: str, n_in: int, n_out: int) -> tuple:
    """The raw call's (input, output) numpy views: of torch-allocated tensors (``mpi4py``), checked to share
    their storage, or numpy's own arrays (``mpi4py-numpy``)."""
    import numpy as np
    import torch

    if impl == "mpi4py-numpy":
        return np.ones(n_in, np.float32), np.zeros(n_out, np.float32)
    ins, outs = torch.ones(n_in, dtype=torch.float32), torch.zeros(n_out, dtype=torch.float32)
    a, b = ins.numpy(), outs.numpy()
    for t, view in ((ins, a), (outs, b)):
        if t.numel() and view.ctypes.data != t.data_ptr():
            raise RuntimeError("torchhpc bench: tensor.numpy() did not share the tensor's memory")
    return a, b


def _shape(coll: str, nbytes: int, n: int) -> tuple[int, int]:
    """(input, output) float32 element counts of one ``coll`` of ``nbytes`` at ``n`` ranks: all_gather's size is
    its output buffer, reduce_scatter's and all_to_all's their input buffer, a multiple of ``n`` elements."""
    numel = max(1, nbytes // 4)
    per = max(1, numel // n)
    return {"allreduce": (numel, 0), "broadcast": (numel, 0), "allgather": (per, per * n),
            "reduce_scatter": (per * n, per), "alltoall": (per * n, per * n)}[coll]


def measured_bytes(coll: str, nbytes: int, n: int) -> int:
    """The bytes a ``coll`` of ``nbytes`` really moves per rank's buffer (more than ``nbytes`` where fewer than
    one float32 per rank: 8 B at 4 ranks is 16 B for all_gather, reduce_scatter and all_to_all)."""
    n_in, n_out = _shape(coll, nbytes, n)
    return 4 * (n_out if coll == "allgather" else n_in)


def _runners(coll: str, nbytes: int, n: int, groups: dict, comm, impls: list[str]) -> dict[str, Callable[[], None]]:
    """One callable per implementation in ``impls`` doing one ``coll`` of ``nbytes`` (float32), each with
    buffers of its own."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    out: dict[str, Callable[[], None]] = {}
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch >= 2.13 name
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    n_in, n_out = _shape(coll, nbytes, n)
    for impl in impls:
        if impl in ("mpi4py", "mpi4py-numpy"):
            a, b = _raw_buffers(impl, n_in, n_out)
            out[impl] = {"allreduce": lambda a=a: comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM),
                         "broadcast": lambda a=a: comm.Bcast(a, 0),
                         "allgather": lambda a=a, b=b: comm.Allgather(a, b),
                         "reduce_scatter": lambda a=a, b=b: comm.Reduce_scatter_block(a, b, MPI.SUM),
                         "alltoall": lambda a=a, b=b: comm.Alltoall(a, b)}[coll]
            continue
        ins, outs = torch.ones(n_in, dtype=torch.float32), torch.zeros(n_out, dtype=torch.float32)
        g = groups[impl]
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


def _bw(gbs: float) -> str:
    """A bandwidth in at most 7 characters, 3 significant digits."""
    return f"{gbs:.0f}" if gbs >= 1000 else f"{gbs:.3g}" if gbs >= 0.001 else f"{gbs:.1e}"


def legend(repeats: int) -> str:
    """What the columns of :func:`print_table` mean (printed once, above the tables)."""
    return "\n".join([
        f"# time: us per call, the median of {repeats} interleaved round(s), a round being the slowest rank's "
        "mean over its calls;",
        "# spread: (max - min) / median of those round means; busbw: GB/s, algbw (size / time) x the nccl-tests "
        "factor;",
        f"# raw = {LABELS[RAW]}, the plain MPI call on the tensors' own memory. accl-raw: accl's time - raw's (us); "
        "bw x: accl busbw / raw busbw,",
        "#   rounds: that ratio round by round (min-max); upstream/accl, gloo/accl: their time / accl's (> 1: accl "
        "faster);",
        f"# targets a row misses: +us (below 1 MiB, accl > raw + {TARGET_EXTRA_US:g} us), bw (from 1 MiB, bw x < "
        f"{TARGET_BW_RATIO}), up (mpi-upstream not slower than accl).",
    ])


def _upstream_unavailable(comm) -> str | None:
    """Why ``mpi-upstream`` cannot run on some rank (the same answer on every rank), or None."""
    why = None
    try:
        import torchhpc.mpi_upstream as upstream

        upstream.load()
    except Exception as exc:  # ImportError when not built; OSError/RuntimeError from a broken build
        why = f"{type(exc).__name__}: {exc}"
    return next((w for w in comm.allgather(why) if w), None)


def _settle(groups: dict) -> None:
    """Wait until upstream's worker thread has dropped the Work of every call made so far: it destroys a Work
    after completing it, and the last reference to a tensor dropped there takes the GIL from that thread.  Its
    barrier is queued behind them and holds no tensor."""
    import torch.distributed as dist

    if "mpi-upstream" in groups:
        dist.barrier(group=groups["mpi-upstream"])


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


def _setup_groups(comm, impls: list[str], say: Callable[..., None]) -> tuple[dict, dict[str, str]]:
    """The process group of every implementation in ``impls`` (accl's is the default group) and the ones
    skipped with their reason: ``mpi-upstream`` is dropped from ``impls`` where its module cannot load."""
    import torch.distributed as dist

    skipped: dict[str, str] = {}
    groups = {"accl": dist.group.WORLD}  # (every rank parses the same --impls: the groups match)
    if "mpi-upstream" in impls:
        why = _upstream_unavailable(comm)
        if why is None:
            import torchhpc.mpi_upstream as upstream

            groups["mpi-upstream"] = dist.new_group(backend=upstream.NAME)
        else:
            skipped["mpi-upstream"] = why
            impls.remove("mpi-upstream")
            say(f"torchhpc bench: skipping mpi-upstream (PyTorch's MPI backend, `make mpi-backend`): {why}",
                flush=True)
    if "gloo" in impls:
        groups["gloo"] = dist.new_group(backend="gloo")
    return groups, skipped


def _teardown(groups: dict, comm) -> None:
    """Destroy every group, the extra ones first, and free ``comm``: upstream's worker thread is joined (its
    group destroyed) before the interpreter finalizes, as a thread taking the GIL during finalization aborts
    the process."""
    import torch.distributed as dist

    for impl in [i for i in groups if i != "accl"]:
        dist.destroy_process_group(groups.pop(impl))
    dist.destroy_process_group()
    comm.Free()


def _time_size(coll: str, size: int, n: int, groups: dict, comm, impls: list[str], repeats: int,
               budget: float, quick: bool) -> list[Point]:
    """One point per implementation for one ``coll`` of ``size`` bytes, timed in ``repeats`` interleaved rounds
    (each starting one further along ``impls``) so that a noisy machine hurts every implementation alike."""
    runners = _runners(coll, size, n, groups, comm, impls)
    here = {impl: Point(coll, n, size, impl) for impl in impls}
    for r in range(repeats):
        for impl in impls[r % len(impls):] + impls[:r % len(impls)]:
            here[impl].rounds_s.append(mean_call_time(runners[impl], comm, budget, quick))
    _settle(groups)
    del runners
    return list(here.values())


def _time_collective(coll: str, args: argparse.Namespace, n: int, groups: dict, comm, impls: list[str],
                     repeats: int) -> list[Point]:
    """Every size of one collective timed (see :func:`_time_size`); rank 0 prints its table and duration."""
    t_coll = time.perf_counter()
    budget = args.time_per_point / repeats
    rows: list[Point] = []
    for size in dict.fromkeys(measured_bytes(coll, s, n) for s in _sizes(args)):
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
        write_svg(args.plot, points, impls)
        print(f"wrote {args.plot}")


def run(args: argparse.Namespace) -> int:
    """Benchmark body, executed by every rank of an MPI job."""
    import torch.distributed as dist
    from mpi4py import MPI

    import torchhpc.accl as accl

    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    opts = accl.AcclOptions(check=not args.no_check)
    dist.init_process_group("accl", pg_options=opts)
    impls = [i for i in dict.fromkeys(args.impls.split(",")) if i in IMPLS]
    groups, skipped = _setup_groups(comm, impls, say)
    if not impls:
        say("torchhpc bench: no implementation left to time", flush=True)
        _teardown(groups, comm)
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
    _settle(groups)
    _teardown(groups, comm)
    return 0


# ---- the table --------------------------------------------------------------------------------------------


def _targets(size: int, t: dict[str, float]) -> str:
    """The targets a row misses (``ok`` when none): ``+us`` (below 1 MiB, accl more than 2 us over raw),
    ``bw`` (from 1 MiB, accl's busbw under 0.95x raw's), ``up`` (mpi-upstream as fast or faster)."""
    if "accl" not in t:
        return "-"
    miss = []
    if RAW in t and size < SMALL_BELOW and (t["accl"] - t[RAW]) * 1e6 > TARGET_EXTRA_US:
        miss.append("+us")
    if RAW in t and size >= SMALL_BELOW and t[RAW] / t["accl"] < TARGET_BW_RATIO:
        miss.append("bw")
    if "mpi-upstream" in t and t["mpi-upstream"] <= t["accl"]:
        miss.append("up")
    return ",".join(miss) or "ok"


GROUP_W = 24  # the width of one implementation's column group (time, spread, busbw)


def _ratio_columns(have: set[str]) -> tuple[bool, list[str]]:
    """Which of accl's ratio columns a table has: accl vs raw MPI (both timed), and the other backends
    (``mpi-upstream``, ``gloo``) timed beside accl."""
    raw_ratio = {"accl", RAW} <= have
    others = [i for i in ("mpi-upstream", "gloo") if i in have and "accl" in have]
    return raw_ratio, others


def _ratio_head(raw_ratio: bool, others: list[str]) -> str:
    """The second header line's ratio part: accl - raw, bw x and its rounds, one column per other backend,
    the targets ("" with no ratio column)."""
    if not (raw_ratio or others):
        return ""
    head = f" {'accl-raw':>8} {'bw x':>5} {'rounds':>9}" if raw_ratio else ""
    for i in others:
        head += f" {('upstream' if i == 'mpi-upstream' else i) + '/accl':>13}"
    return head + f" {'targets':>8}"


def _print_head(impls: list[str], raw_ratio: bool, others: list[str]) -> None:
    """Print the two header lines: the implementations' names over their column groups, then the columns."""
    head1 = f"#{'':>9}" + "".join(f" | {LABELS[impl]:^{GROUP_W}}" for impl in impls)
    head2 = f"#{'size':>9}" + "".join(f" | {'time':>9} {'spread':>6} {'busbw':>7}" for _ in impls)
    ratios2 = _ratio_head(raw_ratio, others)
    if ratios2:
        head1 += f" | {'accl vs the others':^{len(ratios2) - 1}}"
        head2 += " |" + ratios2
    print(head1.rstrip())
    print(head2.rstrip())


def _impl_cells(pts: dict[str, Point], impls: list[str]) -> str:
    """One row's column groups: per implementation its median time (us), spread and busbw, ``-`` if untimed."""
    cells = ""
    for impl in impls:
        if impl not in pts:
            cells += f" | {'-':>{GROUP_W}}"
            continue
        p = pts[impl]
        cells += f" | {p.median_s * 1e6:9.1f} {p.spread * 100:5.1f}% {_bw(p.busbw()):>7}"
    return cells


def _ratio_cells(size: int, pts: dict[str, Point], t: dict[str, float], raw_ratio: bool,
                 others: list[str]) -> str:
    """One row's ratio part: accl - raw (us), raw/accl time with its per-round range, the other backends'
    time / accl's, and the targets missed ("" with no ratio column)."""
    if not (raw_ratio or others):
        return ""
    cells = " |"
    if raw_ratio:
        paired = [m / a for a, m in zip(pts["accl"].rounds_s, pts[RAW].rounds_s, strict=False)]
        cells += (f" {(t['accl'] - t[RAW]) * 1e6:8.1f} {t[RAW] / t['accl']:5.2f} "
                  f"{min(paired):4.2f}-{max(paired):4.2f}")
    for i in others:
        cells += f" {t[i] / t['accl']:12.2f}x"
    return cells + f" {_targets(size, t):>8}"


def _print_targets_summary(by_size: dict[int, dict[str, Point]], have: set[str]) -> None:
    """Print at how many sizes accl met its targets and which it missed (only where there is a target)."""
    if not ("accl" in have and (RAW in have or "mpi-upstream" in have)):
        return
    missed = [f"{_human(s)} ({m})" for s in sorted(by_size)
              if (m := _targets(s, {i: by_size[s][i].median_s for i in by_size[s]})) not in ("ok", "-")]
    print(f"# targets met at {len(by_size) - len(missed)} of {len(by_size)} sizes"
          + (f"; missed: {', '.join(missed)}" if missed else ""))


def print_table(rows: list[Point], impls: list[str], repeats: int) -> None:
    """Print one collective's table at one rank count (nccl-tests style): per implementation the median time,
    the rounds' spread and busbw; then accl's ratios to raw MPI and to the other backends."""
    coll, n = rows[0].collective, rows[0].ranks
    impls = [i for i in impls if any(p.impl == i for p in rows)]
    by_size: dict[int, dict[str, Point]] = {}
    for p in rows:
        by_size.setdefault(p.size, {})[p.impl] = p
    have = set(impls)
    raw_ratio, others = _ratio_columns(have)
    print(f"\n# {coll}, float32, {n} ranks, median of {repeats} round(s), busbw factor {bus_factor(coll, n):.3g}")
    _print_head(impls, raw_ratio, others)
    for size in sorted(by_size):
        pts = by_size[size]
        t = {i: pts[i].median_s for i in impls if i in pts}
        line = f"{_human(size):>10}" + _impl_cells(pts, impls) + _ratio_cells(size, pts, t, raw_ratio, others)
        print(line.rstrip(), flush=True)
    _print_targets_summary(by_size, have)


# ---- JSON -------------------------------------------------------------------------------------------------


def write_json(path: str, meta: dict, points: Iterable[Point]) -> None:
    """Write ``meta`` and every point (round means and median, seconds) to ``path``."""
    rows = [dict(asdict(p), label=LABELS.get(p.impl, p.impl), median_s=p.median_s, busbw_GBps=p.busbw())
            for p in points]
    with open(path, "w") as f:
        json.dump({"meta": meta, "points": rows}, f, indent=1)
        f.write("\n")


def read_json(paths: Iterable[str]) -> tuple[list[dict], list[Point]]:
    """The metas and points of ``--json`` files (several runs, e.g. 2 and 4 ranks, merged)."""
    metas, points = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if data.get("meta", {}).get("format") != JSON_FORMAT:
            raise ValueError(f"{path}: not a `torchhpc bench --json` file ({JSON_FORMAT})")
        metas.append(data["meta"])
        points += [Point(r["collective"], r["ranks"], r["size"], r["impl"], list(r["rounds_s"]))
                   for r in data["points"]]
    return metas, points


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
        write_svg(args.plot, points, impls)
        print(f"wrote {args.plot}")
    return 0


# ---- the SVG plot -----------------------------------------------------------------------------------------

COLORS = {"accl": "#d62728", "mpi-upstream": "#1f77b4", "gloo": "#2ca02c",
          "mpi4py": "#222222", "mpi4py-numpy": "#8c8c8c"}
DASHES = {"mpi4py": "5,3", "mpi4py-numpy": "2,2"}


def _size_ticks(lo: float, hi: float) -> list[int]:
    """log2 exponents to label from ``lo`` to ``hi``: both ends, and 1 KiB, 1 MiB, 1 GiB (every 8x on a short
    axis) where not crowding an end."""
    step = 10 if hi - lo > 12 else 3
    ends = sorted({math.ceil(lo), math.floor(hi)})
    inner = [e for e in range(ends[0] + 1, ends[-1]) if e % step == 0 and min(abs(e - x) for x in ends) >= 3]
    return sorted(ends + inner)


PANEL_W, PANEL_H = 300, 230  # one panel's size
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 52, 22, 26, 40  # a panel's margins around its plot area
LEGEND_H = 30


@dataclass
class _Panel:
    """One panel's plot area (pixels) and the data range every panel shares (log2 bytes, log10 GB/s)."""

    ox: int
    oy: int
    w: int
    h: int
    x0: float
    x1: float
    y0: int
    y1: int

    def px(self, v: float) -> float:
        """The pixel x of log2(size) ``v``."""
        return self.ox + (v - self.x0) / (self.x1 - self.x0) * self.w

    def py(self, v: float) -> float:
        """The pixel y of log10(busbw) ``v``."""
        return self.oy + self.h - (v - self.y0) / (self.y1 - self.y0) * self.h


def _dash(impl: str) -> str:
    """The stroke-dasharray attribute of ``impl``'s line ("" for a solid line): the raw MPI lines are dashed."""
    return f' stroke-dasharray="{DASHES[impl]}"' if impl in DASHES else ""


def _svg_ranges(good: list[Point]) -> tuple[float, float, int, int]:
    """The shared axes' ranges (x0, x1 in log2 bytes; y0, y1 whole decades of GB/s) covering ``good``, at
    least one unit wide."""
    xs = [math.log2(p.size) for p in good] or [0.0, 1.0]
    ys = [math.log10(p.busbw()) for p in good] or [0.0, 1.0]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0 = math.floor(min(ys))
    y1 = max(math.ceil(max(ys)), y0 + 1)
    return x0, x1, y0, y1


def _svg_legend(impls: list[str], width: int) -> list[str]:
    """The legend line along the top: a line sample and label per implementation, the axes' meaning right."""
    out = []
    lx = 10
    for impl in impls:
        out.append(f'<line x1="{lx}" y1="15" x2="{lx + 24}" y2="15" stroke="{COLORS[impl]}" stroke-width="2"'
                   f'{_dash(impl)}/>')
        out.append(f'<text x="{lx + 28}" y="19" font-size="11">{escape(LABELS.get(impl, impl))}</text>')
        lx += 40 + 7 * len(LABELS.get(impl, impl))
    out.append(f'<text x="{width - 10}" y="19" text-anchor="end" fill="#555">busbw (GB/s, log) vs message size '
               f'(log2), float32</text>')
    return out


def _svg_axes(pn: _Panel, title: str) -> list[str]:
    """One panel's title, frame, grid and tick labels: a decade per GB/s line, sizes from :func:`_size_ticks`."""
    ox, oy, w, h = pn.ox, pn.oy, pn.w, pn.h
    out = [f'<text x="{ox + w / 2:.1f}" y="{oy - 8}" text-anchor="middle" font-size="12" '
           f'font-weight="bold">{title}</text>',
           f'<rect x="{ox}" y="{oy}" width="{w}" height="{h}" fill="none" stroke="#999"/>']
    for e in range(pn.y0, pn.y1 + 1):
        y = pn.py(e)
        out.append(f'<line x1="{ox}" y1="{y:.1f}" x2="{ox + w}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{ox - 4}" y="{y + 3:.1f}" text-anchor="end">{10.0 ** e:g}</text>')
    for e in _size_ticks(pn.x0, pn.x1):
        x = pn.px(e)
        out.append(f'<line x1="{x:.1f}" y1="{oy}" x2="{x:.1f}" y2="{oy + h}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{x:.1f}" y="{oy + h + 13}" text-anchor="middle">'
                   f'{_human(1 << e).replace(" ", "")}</text>')
    out.append(f'<text x="{ox + w / 2:.1f}" y="{oy + h + 28}" text-anchor="middle" fill="#555">'
               f'message size</text>')
    return out


def _svg_line(pn: _Panel, impl: str, pts: list[Point]) -> list[str]:
    """One implementation's busbw line in a panel, a dot per measured size (nothing without points)."""
    if not pts:
        return []
    xy = [(pn.px(math.log2(p.size)), pn.py(math.log10(p.busbw()))) for p in sorted(pts, key=lambda p: p.size)]
    return ([f'<polyline fill="none" stroke="{COLORS[impl]}" stroke-width="1.6"{_dash(impl)} points="'
             + " ".join(f"{x:.1f},{y:.1f}" for x, y in xy) + '"/>']
            + [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.2" fill="{COLORS[impl]}"/>' for x, y in xy])


def _svg_panel(pn: _Panel, coll: str, n: int, good: list[Point], impls: list[str]) -> list[str]:
    """The panel of ``coll`` at ``n`` ranks: its axes, then one line per implementation in ``impls`` order."""
    out = _svg_axes(pn, f"{coll}, {n} ranks")
    for impl in impls:
        out += _svg_line(pn, impl, [p for p in good if p.ranks == n and p.collective == coll and p.impl == impl])
    return out


def write_svg(path: str, points: list[Point], impls: list[str]) -> None:
    """Busbw vs size (log-log), one panel per collective (columns) and rank count (rows), one line per
    implementation, written as a self-contained SVG."""
    impls = [i for i in impls if any(p.impl == i for p in points)]
    colls = [c for c in COLLECTIVES if any(p.collective == c for p in points)]
    ranks = sorted({p.ranks for p in points})
    width, height = PANEL_W * len(colls), LEGEND_H + PANEL_H * len(ranks)
    good = [p for p in points if p.busbw() > 0]
    ranges = _svg_ranges(good)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    out += _svg_legend(impls, width)
    for row, n in enumerate(ranks):
        for col, coll in enumerate(colls):
            pn = _Panel(col * PANEL_W + MARGIN_L, LEGEND_H + row * PANEL_H + MARGIN_T,
                        PANEL_W - MARGIN_L - MARGIN_R, PANEL_H - MARGIN_T - MARGIN_B, *ranges)
            out += _svg_panel(pn, coll, n, good, impls)
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main(argv: list[str]) -> int:
    """Entry point of ``torchhpc bench``: relaunch under mpiexec unless already inside an MPI job."""
    args = _parse(list(argv))
    if args.np < 1:
        print("torchhpc bench: --np must be >= 1", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print("torchhpc bench: --repeats must be >= 1", file=sys.stderr)
        return 2
    if args.plot and not args.plot.endswith(".svg"):
        print("torchhpc bench: --plot writes SVG: give a path ending in .svg", file=sys.stderr)
        return 2
    unknown = [i for i in args.impls.split(",") if i not in IMPLS]
    if unknown:
        print(f"torchhpc bench: unknown --impls {','.join(unknown)} (known: {','.join(IMPLS)})", file=sys.stderr)
        return 2
    if args.from_json:
        return _replay(args)
    if not _under_mpi():
        return _relaunch(list(argv), args.np)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
