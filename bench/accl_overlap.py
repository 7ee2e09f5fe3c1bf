"""Communication beside compute: a DDP-shaped iteration on every backend, what a data-parallel step feels.

Each rank runs matmuls, issues an async all_reduce of DDP's first bucket (1 MiB), runs more matmuls, issues one
of its second (``--bucket-mib``), and waits for both; ``--skew`` more matmuls on the odd ranks make them late, as a
slower backward pass would.  Time per iteration (the slowest rank's mean) in ``--rounds`` interleaved rounds,
against the same iteration with no communication (the compute floor).  With every core busy computing, a backend
whose waiting thread spins, yields or sleeps at the wrong moment costs the compute its time here, where a
microbenchmark of the collective alone shows nothing.

    mpiexec -n 2 python bench/accl_overlap.py [--rounds 15] [--iters 20] [--skew 0] [--quick]
                                              [--impls floor,accl,mpi-upstream,gloo]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

if "torchhpc" not in sys.modules:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

IMPLS = ("floor", "accl", "mpi-upstream", "gloo")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=20, help="iterations per round and implementation")
    ap.add_argument("--skew", type=int, default=0, help="extra matmuls on odd ranks before the first bucket")
    ap.add_argument("--bucket-mib", type=float, default=9.7, help="the second bucket's size")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--quick", action="store_true", help="3 rounds of 3 iterations (seconds)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.iters = 3, 3
    impls = [i for i in args.impls.split(",") if i]
    unknown = set(impls) - set(IMPLS)
    if unknown:
        ap.error(f"unknown implementations {sorted(unknown)}; known: {', '.join(IMPLS)}")

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from torchhpc.bench.timing import interleaved, per_call_s, slowest, summary
    from torchhpc.launcher import init_distributed

    init_distributed(backend="accl")
    rank, comm = dist.get_rank(), MPI.COMM_WORLD
    groups: dict[str, object] = {"accl": None}
    if "gloo" in impls:
        groups["gloo"] = dist.new_group(backend="gloo")
    if "mpi-upstream" in impls:
        import torchhpc.mpi_upstream as upstream

        try:
            upstream.load()
            groups["mpi-upstream"] = dist.new_group(backend=upstream.NAME)
        except Exception as exc:  # noqa: BLE001 (not built here: say so and go on)
            impls.remove("mpi-upstream")
            if rank == 0:
                print(f"# skipping mpi-upstream: {type(exc).__name__}: {exc}")
    first, second = torch.ones(1 << 18), torch.ones(int(args.bucket_mib * (1 << 18)))
    a = torch.randn(256, 256)
    late = args.skew if rank % 2 else 0

    def iteration(group, communicate: bool) -> None:
        for _ in range(20 + late):
            a @ a
        w1 = dist.all_reduce(first, group=group, async_op=True) if communicate else None
        for _ in range(40):
            a @ a
        w2 = dist.all_reduce(second, group=group, async_op=True) if communicate else None
        if communicate:
            w1.wait()
            w2.wait()

    fns = {i: functools.partial(iteration, groups.get(i), i != "floor") for i in impls}

    def timed(fn) -> float:  # noqa: ANN001
        comm.Barrier()
        return slowest(comm, per_call_s(fn, args.iters)) * 1e3

    for fn in fns.values():
        fn()
    times = interleaved(fns, args.rounds, timed)
    if rank == 0:
        threads = torch.get_num_threads()
        print(f"# {dist.get_world_size()} ranks, {threads} compute thread(s) each, {args.rounds} interleaved rounds of "
              f"{args.iters} iterations; ms per iteration (slowest rank's mean), median [min-max]; buckets 1 and "
              f"{args.bucket_mib} MiB, skew {args.skew} matmuls (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})")
        floor = summary(times["floor"])[0] if "floor" in times else None
        for name, ts in times.items():
            med, lo, hi = summary(ts)
            over = f"  over the floor {med - floor:+.2f} ms" if floor is not None and name != "floor" else ""
            print(f"{name:>14} {med:8.2f} [{lo:.2f}-{hi:.2f}]{over}")
    for group in groups.values():
        if group is not None:
            dist.destroy_process_group(group)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
