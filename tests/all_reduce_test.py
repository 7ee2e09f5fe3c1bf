#!/usr/bin/env python3
"""All-reduce smoke test and bandwidth table for a cluster job, in the style of nccl-tests.

    mpiexec -n 8 -ppn 4 ./tests/all_reduce_test.py --backend nccl
    torchrun --nproc-per-node 4 tests/all_reduce_test.py --backend gloo --device cpu

Every result is checked against the exact expected sum; any wrong element makes the exit status 1.
busbw = algbw * 2(n-1)/n, the ring all-reduce bus bandwidth, comparable across rank counts.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}
NCCL_TYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "half",
                   torch.bfloat16: "bfloat16", torch.int32: "int32", torch.int64: "int64"}
PATTERN = 5  # element i of rank r holds (r + 1) * (i % PATTERN + 1): small integers, exact in every dtype


def parse_size(text: str) -> int:
    """Bytes from ``8``, ``64K``, ``1M``, ``2G`` (binary units, as nccl-tests reads them)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 8, 64K, 1M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def sizes(minbytes: int, maxbytes: int, factor: int, itemsize: int) -> list[int]:
    """Message sizes from ``minbytes`` to ``maxbytes`` multiplying by ``factor``, whole elements only."""
    out, size = [], max(minbytes, itemsize)
    while size <= maxbytes:
        out.append(size - size % itemsize)
        size *= factor
    return out


def fill(buf: torch.Tensor, rank: int) -> None:
    """Put this rank's contribution into ``buf``."""
    pattern = torch.arange(buf.numel(), device=buf.device) % PATTERN + 1
    buf.copy_((pattern * (rank + 1)).to(buf.dtype))


def count_wrong(result: torch.Tensor, world_size: int) -> int:
    """Elements of an all-reduced (sum) buffer that differ from the exact expected value."""
    pattern = torch.arange(result.numel(), device=result.device) % PATTERN + 1
    expected = pattern.double() * (world_size * (world_size + 1) // 2)
    got = result.double()
    if result.dtype in (torch.float16, torch.bfloat16):
        # Sums above the dtype's exact-integer range are rounded; allow that rounding, nothing more.
        tol = expected * (2.0 ** -(8 if result.dtype == torch.bfloat16 else 11)) * world_size
        return int(((got - expected).abs() > tol).sum())
    return int((got != expected).sum())


def versions() -> str:
    parts = [f"torch {torch.__version__}"]
    if torch.cuda.is_available() and dist.is_nccl_available():
        parts.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
    try:
        from torchhpc.runtime.mpi_info import library_version

        parts.append(library_version().split(", package:")[0])
    except ImportError:
        parts.append("MPI: mpi4py not available")
    return "  ".join(parts)


def run(args: argparse.Namespace) -> int:
    from torchhpc.launcher import init_distributed

    info = init_distributed(backend=args.backend, timeout=args.timeout)
    rank, n = info.rank, info.world_size
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    bus_factor = 2 * (n - 1) / n if n > 1 else 1.0

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # nccl-tests' placement lines: where every rank runs (one line per rank, printed by rank 0)
    hosts: list = [None] * n
    dist.all_gather_object(hosts, (socket.gethostname(), os.getpid()))
    if rank == 0:
        print(f"# torchhpc all_reduce_test: backend {args.backend}, {n} ranks, device {device.type}, "
              f"launcher {info.launcher}, {info.local_size} ranks per node")
        print(f"# {versions()}")
        for r, (host, pid) in enumerate(hosts):
            print(f"#  Rank {r:>3} Pid {pid:>7} on {host:>12} device {device}")
        print("#")
        print(f"# {'size':>12} {'count':>12} {'type':>9} {'redop':>6} {'time':>10} {'algbw':>8} {'busbw':>8} "
              f"{'#wrong':>7}")
        print(f"# {'(B)':>12} {'(elements)':>12} {'':>9} {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}")
    total_wrong, busbws = 0, []
    for nbytes in sizes(args.minbytes, args.maxbytes, args.stepfactor, itemsize):
        count = nbytes // itemsize
        work = torch.zeros(count, dtype=dtype, device=device)
        for _ in range(args.warmup_iters):
            dist.all_reduce(work)
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(work)
        sync()
        elapsed = torch.tensor([(time.perf_counter() - start) / args.iters], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        check = torch.empty(count, dtype=dtype, device=device)
        fill(check, rank)
        dist.all_reduce(check)
        wrong = torch.tensor([count_wrong(check, n)], dtype=torch.int64, device=device)
        dist.all_reduce(wrong)
        seconds, n_wrong = elapsed.item(), int(wrong.item())
        total_wrong += n_wrong
        algbw = nbytes / seconds / 1e9
        busbws.append(algbw * bus_factor)
        if rank == 0:
            print(f"  {nbytes:>12} {count:>12} {NCCL_TYPE_NAMES[dtype]:>9} {'sum':>6} {seconds * 1e6:>10.2f} "
                  f"{algbw:>8.3f} {algbw * bus_factor:>8.3f} {n_wrong:>7}", flush=True)
    if rank == 0:
        print(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
        print(f"# Avg bus bandwidth    : {sum(busbws) / max(len(busbws), 1):.4f} GB/s")
    dist.destroy_process_group()
    return 0 if total_wrong == 0 else 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo",
                        choices=["gloo", "mpi", "nccl", "accl"], help="torch.distributed backend")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    parser.add_argument("-f", "--stepfactor", type=int, default=2)
    parser.add_argument("-w", "--warmup-iters", type=int, default=5)
    parser.add_argument("-n", "--iters", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective is declared hung")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no GPU is visible")
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda")
    if args.stepfactor < 2 or args.iters < 1 or args.warmup_iters < 0:
        parser.error("need --stepfactor >= 2, --iters >= 1, --warmup-iters >= 0")
    if args.minbytes > args.maxbytes:
        parser.error(f"--minbytes {args.minbytes} > --maxbytes {args.maxbytes}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
