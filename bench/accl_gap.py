"""Where accl's extra time on one large collective goes, in steps from raw MPI up to the torch call.

Run under MPI (``mpiexec -n 2 python bench/accl_gap.py [--collective all_to_all] [--bytes 1048576]``).
In the same job, interleaved rounds time, per call on the slowest rank:

1. ``raw``: the plain mpi4py call on numpy buffers (what ``torchhpc bench`` compares with);
2. ``raw+header``: the same call after the exchange a checked accl call makes first, modelled as one
   header-sized message (``wire.HEADER_BYTES``) each way with each recursive-doubling partner (``MPI_Sendrecv``;
   the ranks past a power of two are left out of the model);
3. ``backend``: the C++ backend's own method (``ProcessGroupACCL::allreduce`` ..., through its pybind11
   binding, then ``wait()``): header, check, MPI call;
4. ``group``: the group's method called as torch's wrapper calls it, with ready options (torch's
   ``ProcessGroup`` and its dispatcher, then the backend);
5. ``torch``: the user's call, ``dist.<collective>`` on the accl group (torch's Python wrapper on top).

Each step's excess over the previous one is that layer's cost.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "torchhpc" not in sys.modules:
    sys.path.insert(0, os.environ.get("ACCL_GAP_SRC", str(Path(__file__).resolve().parents[1] / "src")))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--collective", choices=("all_to_all", "all_gather", "all_reduce"), default="all_to_all")
    ap.add_argument("--bytes", type=int, default=1 << 20, help="send buffer (all_gather: output buffer) bytes")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--iters", type=int, default=1500)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import torchhpc.accl  # noqa: F401  (registers "accl")
    from torchhpc.accl import core
    from torchhpc.bench.timing import interleaved, per_call_s, slowest, summary

    wire = core.load_backend().wire  # the wire protocol as the backend defines it

    dist.init_process_group("accl")
    comm = MPI.COMM_WORLD.Dup()
    p = comm.Get_size()
    n = max(p, args.bytes // 4 // p * p)  # float32 elements, a multiple of p
    coll = args.collective
    ti = torch.ones(n // p if coll == "all_gather" else n)
    to = torch.empty(n)
    si, so = torch.ones(ti.numel()).numpy(), torch.empty(n).numpy()
    head_out, head_in = bytearray(wire.HEADER_BYTES), bytearray(wire.HEADER_BYTES)
    p2 = 1 << (p.bit_length() - 1)
    rank = comm.Get_rank()
    partners = [rank ^ mask for mask in (1 << k for k in range(p2.bit_length() - 1))] if rank < p2 else []

    raw_call = {"all_to_all": lambda: comm.Alltoall(si, so), "all_gather": lambda: comm.Allgather(si, so),
                "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, si, MPI.SUM)}[coll]

    def with_header() -> None:
        for peer in partners:
            comm.Sendrecv([head_out, MPI.BYTE], peer, 16, [head_in, MPI.BYTE], peer, 16)
        raw_call()

    pg = dist.group.WORLD
    c10d = dist.distributed_c10d  # (where torch's wrappers take their option types from)
    opts = {"all_to_all": c10d.AllToAllOptions, "all_gather": c10d.AllgatherOptions,
            "all_reduce": c10d.AllreduceOptions}[coll]()
    opts.asyncOp = False
    group_call = {"all_to_all": lambda: pg.all_to_all_single(to, ti, [], [], opts),
                  "all_gather": lambda: pg.all_gather_single(to, ti, opts),
                  "all_reduce": lambda: pg.allreduce([ti], opts)}[coll]
    be = pg._get_backend(torch.device("cpu"))
    backend_call = {"all_to_all": lambda: be.alltoall_base(to, ti, [], [], opts).wait(),
                    "all_gather": lambda: be._allgather_base(to, ti, opts).wait(),
                    "all_reduce": lambda: be.allreduce([ti], opts).wait()}[coll]
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch >= 2.13 name
    torch_call = {"all_to_all": lambda: dist.all_to_all_single(to, ti),
                  "all_gather": lambda: all_gather(to, ti),
                  "all_reduce": lambda: dist.all_reduce(ti)}[coll]

    def timed(fn) -> float:  # noqa: ANN001
        per_call_s(fn, 20)
        comm.Barrier()
        return slowest(comm, per_call_s(fn, args.iters)) * 1e6

    steps = {"raw": raw_call, "raw+header": with_header, "backend": backend_call, "group": group_call,
             "torch": torch_call}
    times = interleaved(steps, args.repeats, timed)
    if comm.Get_rank() == 0:
        print(f"# {coll}, {n * 4} bytes, {p} ranks: us per call, median [min-max] of {args.repeats} "
              f"interleaved rounds of {args.iters} calls")
        prev = None
        for name, ts in times.items():
            med, lo, hi = summary(ts)
            step = "" if prev is None else f"  (+{med - prev:.1f})"
            print(f"{name:>12} {med:8.1f} [{lo:.1f}-{hi:.1f}]{step}")
            prev = med
    dist.destroy_process_group()
    comm.Free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
