"""Per-call cost of the accl backend on a one-rank group: what Python adds to every call.

On one rank MPI's collectives are memory copies at most, so the time per call is the backend's own
fixed cost (torch's wrapper, argument checks, plan, header exchange, engine call).  Each case is
timed in ``--repeats`` interleaved rounds against the raw mpi4py call on numpy buffers;
the table shows medians and the min-max spread.  The "torch floor"
column is the same torch call on a Python process group whose method returns at once: what torch's own
Python wrapper (``dist.all_reduce`` and friends, which call such a group's method directly) costs any
backend reached from Python; the "C++ floor" column is the same call on a C++ ``c10d::Backend`` that does
nothing and returns completed Work (``bench/null_backend.cpp``, built here by torch's cpp_extension, about
15 s the first time): what torch's wrapper, its dispatcher and the ``Work`` cost every C++ backend, accl
included; the "gloo" column is the same call on a one-rank gloo group (another C++
``c10d::Backend`` behind torch's dispatcher).  ``--profile CASE`` prints a cProfile of that case instead.

``--cold`` times every call after a copy of 4 MiB (four times a core's L2 here), as a large collective
leaves the caches, and subtracts the copy's own time measured in the same rounds: the per-call cost a
1 MiB collective pays on top of its data movement (code and data of the call path come from L3/DRAM).

``--depth N`` times every call N Python frames deeper, as in a training loop (a recorder that gathers the
caller's stack, as with ``TORCHHPC_ACCL_FLIGHT_STACKS=1``, walks them all).

    python bench/accl_overhead.py [--repeats 7] [--iters 20000] [--cold] [--depth 40] [--profile all_reduce_8B]
                                  [--plot cost.svg]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
from pathlib import Path

if "torchhpc" not in sys.modules:
    sys.path.insert(0, os.environ.get("ACCL_OVERHEAD_SRC", str(Path(__file__).resolve().parents[1] / "src")))


def _null_group():
    """A one-rank group of a Python backend that does nothing: the floor of torch's dispatch."""
    import torch.distributed as dist

    class Null(dist.ProcessGroup):
        def getBackendName(self) -> str:  # noqa: N802 (torch's name)
            return "null"

        def allreduce(self, tensors, opts=None):
            return None

        def broadcast(self, tensors, opts=None):
            return None

        def all_gather_single(self, output, input, opts=None):  # noqa: A002
            return None

        def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002
            return None

        def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
            return None

        def barrier(self, opts=None):
            return None

        _allgather_base = all_gather_single
        _reduce_scatter_base = reduce_scatter_single
        alltoall_base = all_to_all_single

    dist.Backend.register_backend("null", lambda store, rank, size, timeout: Null(rank, size), devices=["cpu"])
    return dist.new_group([0], backend="null")


def _null_cpp_group():
    """A one-rank group of a C++ backend that does nothing: the floor of every C++ backend behind torch's dispatcher."""
    import torch
    import torch.distributed as dist
    from torch.utils import cpp_extension

    ext = cpp_extension.load("torchhpc_null_backend", [str(Path(__file__).with_name("null_backend.cpp"))])

    class NullCpp(dist.ProcessGroup):
        def __init__(self, rank: int, size: int) -> None:
            super().__init__(rank, size)
            self._backend = ext.NullBackend()  # kept alive with the group
            kind = dist.ProcessGroup.BackendType.CUSTOM
            self._register_backend(torch.device("cpu"), kind, self._backend)
            self._set_default_backend(kind)

        def getBackendName(self) -> str:  # noqa: N802 (torch's name)
            return "null_cpp"

    dist.Backend.register_backend("null_cpp", lambda store, rank, size, timeout: NullCpp(rank, size),
                                  devices=["cpu"])
    return dist.new_group([0], backend="null_cpp")


def _cases():
    """name -> (accl, raw mpi4py, torch floor, C++ floor, gloo): one call each."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    null = _null_group()
    cpp = _null_cpp_group()
    py = dist.new_group([0], backend="gloo")  # another C++ backend behind the same dispatcher
    ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    rs = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    out: dict[str, tuple] = {}
    for n in (2, 1024, 1 << 18):  # 8 B, 4 KiB, 1 MiB of float32
        label = {2: "8B", 1024: "4KiB", 1 << 18: "1MiB"}[n]
        t = torch.ones(n)
        a = t.numpy().copy()
        o = torch.empty(n)
        b = o.numpy()
        out[f"all_reduce_{label}"] = (lambda t=t: dist.all_reduce(t),
                                      lambda a=a: comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM),
                                      lambda t=t: dist.all_reduce(t, group=null),
                                      lambda t=t: dist.all_reduce(t, group=cpp),
                                      lambda t=t: dist.all_reduce(t, group=py))
        out[f"broadcast_{label}"] = (lambda t=t: dist.broadcast(t, 0), lambda a=a: comm.Bcast(a, 0),
                                     lambda t=t: dist.broadcast(t, 0, group=null),
                                     lambda t=t: dist.broadcast(t, 0, group=cpp),
                                     lambda t=t: dist.broadcast(t, 0, group=py))
        out[f"all_gather_{label}"] = (lambda t=t, o=o: ag(o, t), lambda a=a, b=b: comm.Allgather(a, b),
                                      lambda t=t, o=o: ag(o, t, group=null), lambda t=t, o=o: ag(o, t, group=cpp),
                                      lambda t=t, o=o: ag(o, t, group=py))
        out[f"reduce_scatter_{label}"] = (lambda t=t, o=o: rs(o, t),
                                          lambda a=a, b=b: comm.Reduce_scatter_block(a, b, MPI.SUM),
                                          lambda t=t, o=o: rs(o, t, group=null),
                                          lambda t=t, o=o: rs(o, t, group=cpp),
                                          lambda t=t, o=o: rs(o, t, group=py))
        out[f"all_to_all_{label}"] = (lambda t=t, o=o: dist.all_to_all_single(o, t),
                                      lambda a=a, b=b: comm.Alltoall(a, b),
                                      lambda t=t, o=o: dist.all_to_all_single(o, t, group=null),
                                      lambda t=t, o=o: dist.all_to_all_single(o, t, group=cpp),
                                      lambda t=t, o=o: dist.all_to_all_single(o, t, group=py))
    out["barrier"] = (lambda: dist.barrier(), lambda: comm.Barrier(), lambda: dist.barrier(group=null),
                      lambda: dist.barrier(group=cpp), lambda: dist.barrier(group=py))
    return out


def _deeper(depth: int, fn, *args):
    """fn(*args) called `depth` Python frames below this one."""
    return fn(*args) if depth <= 0 else _deeper(depth - 1, fn, *args)


def _evictor():
    """A callable that copies 4 MiB: afterwards the next call's code and data come from L3 or DRAM."""
    import torch

    src, dst = torch.ones(1 << 20), torch.empty(1 << 20)
    return lambda: dst.copy_(src)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--profile", default=None, help="cProfile this case instead of timing")
    ap.add_argument("--cases", default="", help="comma-separated subset")
    ap.add_argument("--cold", action="store_true", help="evict the caches before every call (see above)")
    ap.add_argument("--depth", type=int, default=0,
                    help="time from this many Python frames deeper (what a stack-gathering recorder walks)")
    ap.add_argument("--plot", default=None, metavar="PATH",
                    help="also draw the costs as bars here (.png, .svg, .pdf; needs matplotlib)")
    args = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    import torch.distributed as dist

    import torchhpc.accl  # noqa: F401  (registers "accl")
    from torchhpc.bench.timing import interleaved, per_call_s, summary

    dist.init_process_group("accl", rank=0, world_size=1)
    cases = _cases()
    if args.cases:
        cases = {k: v for k, v in cases.items() if k in args.cases.split(",")}
    if args.profile:
        fn = cases[args.profile][0]
        per_call_s(fn, 1000)
        prof = cProfile.Profile()
        prof.enable()
        per_call_s(fn, args.iters)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return 0
    empty = lambda: None  # noqa: E731
    evict = _evictor() if args.cold else empty
    print(f"# accl per-call cost, one rank, us per call{', caches evicted before each call' if args.cold else ''}: "
          f"median [min-max] of {args.repeats} interleaved rounds of {args.iters} calls (src {torchhpc_src()})")
    costs: dict[str, dict[str, tuple[float, float, float]]] = {}
    cols = {"accl": "accl", "raw": "mpi4py", "floor": "torch floor", "cpp": "C++ floor", "gloo": "gloo"}
    print(" | ".join([f"{'case':>20}", *(f"{c:>20}" for c in cols.values()),
                      f"{'accl - mpi4py':>13}", f"{'accl - floor':>12}", f"{'accl - C++ floor':>16}"]))
    for name, impls in cases.items():
        iters = args.iters if "1MiB" not in name else max(200, args.iters // 50)
        if args.cold:
            if "1MiB" in name:
                continue  # a 1 MiB call evicts the caches itself
            iters = max(500, iters // 4)
        fns = {**dict(zip(cols, impls, strict=True)), "evict": evict}
        if args.cold:  # each call after the eviction; the eviction's own time is taken off below
            fns.update({k: lambda f=f: (evict(), f()) for k, f in fns.items() if k != "evict"})
        for fn in fns.values():
            per_call_s(fn, max(10, iters // 20))
        times = _deeper(args.depth, interleaved, fns, args.repeats, lambda fn, n=iters: per_call_s(fn, n) * 1e6)
        evicted = times.pop("evict")
        if args.cold:  # paired by round
            times = {k: [t - e for t, e in zip(ts, evicted, strict=True)] for k, ts in times.items()}
        med = {k: summary(ts)[0] for k, ts in times.items()}
        cells = [f"{m:8.2f} [{lo:5.2f}-{hi:5.2f}]" for m, lo, hi in map(summary, times.values())]
        gaps = [f"{med['accl'] - med['raw']:13.2f}", f"{med['accl'] - med['floor']:12.2f}",
                f"{med['accl'] - med['cpp']:16.2f}"]
        print(" | ".join([f"{name:>20}", *cells, *gaps]))
        costs[name] = {label: summary(times[k]) for k, label in cols.items()}
    dist.destroy_process_group()
    if args.plot:
        from torchhpc.bench.plot import write_cost_plot

        write_cost_plot(args.plot, costs, f"per-call cost, one rank{', caches evicted' if args.cold else ''}"
                        f" ({args.repeats} rounds of {args.iters} calls)")
        print(f"# plot: {args.plot}")
    return 0


def torchhpc_src() -> str:
    import torchhpc

    return str(Path(torchhpc.__file__).resolve().parents[1])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
