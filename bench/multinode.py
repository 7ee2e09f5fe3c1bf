"""Benchmarks across nodes of the virtual cluster (2, or ``--nodes N``), at several link rates, each against a
baseline of the same run.

For every link rate (``tc`` token bucket on each node's veth; ``none``: unshaped) this measures, in order:

1. the link itself: TCP goodput node1 -> node2 of one socket (the physical limit every ratio below uses);
2. accl vs raw mpi4py vs gloo, all_reduce latency and busbw by size (``torchhpc bench``, one rank per node)
   and an SVG of busbw against size;
3. chunkstore: random-row gathers whose rows all live on other nodes (remote tier), their rows moved by MPI
   (the default) and by gloo, GB/s of remote bytes as a fraction of the link's goodput, next to a bare gloo
   ``all_to_all_single`` of the same bytes;
4. rehearsal: remote fetch over the MPI transport and over Thallium (``ofi+tcp``) with raw MPI ``Get`` s
   (bench/rehearsal_transport.py) and the training loop's overhead with the peers on other nodes
   (bench/rehearsal.py, with either transport), both one rank per node.

Needs root and a virtual cluster of at least ``--nodes`` nodes (``make cluster-up NODES=2``); prints Markdown
tables::

    python bench/multinode.py --rates none,10gbit,1gbit            # about 8 min on 2 cores
    python bench/multinode.py --rates 1gbit --nodes 4              # 4 nodes: files named *-1gbit-4nodes
    python bench/multinode.py --rates 1gbit --quick                # about 1 min
    python bench/multinode.py --rates 10gbit --parts chunkstore    # the link, then only the gathers
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from torchhpc.accl.options import default_spin_us
from torchhpc.runtime.mpirun import across_hosts

ROOT = Path(__file__).resolve().parents[1]
VCLUSTER = ROOT / "utils" / "vcluster" / "vcluster.sh"
PORT = 5201


def on_cluster(cmd: str, node: str = "node1", timeout: float = 900) -> str:
    """Run ``cmd`` in a login shell on ``node``; its output, or exit with it on failure."""
    proc = subprocess.run(["bash", str(VCLUSTER), "exec", "-n", node, "bash", "-c", cmd], capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"`{cmd}` failed on {node} ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def hosts(nodes: int) -> str:
    return ",".join(f"node{i}" for i in range(1, nodes + 1))


def mpiexec(argv: list[str], nodes: int) -> str:
    """One rank on each of node1 .. node<nodes>.  The virtual nodes share this host's cores, which no rank can see
    (each node holds one): accl's waits are told to spin as for ``nodes`` ranks on this host (briefly where they
    outnumber the cores; docs/accl.md, "Communication beside compute")."""
    env = {"OMP_NUM_THREADS": "1", "TORCHHPC_ACCL_SPIN_US": str(default_spin_us(ranks_on_node=nodes))}
    spread = across_hosts(hosts(nodes), nodes, env, forward=tuple(env))
    return " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(["mpiexec", "-n", str(nodes), *spread,
                                                                            *argv])


# ---- 1. the link -------------------------------------------------------------------------------------------


def link_worker(role: str, seconds: float) -> None:
    """``recv``: accept one connection and count bytes; ``send``: stream to node2 for ``seconds``."""
    chunk = bytearray(1 << 20)
    if role == "recv":
        with socket.create_server(("0.0.0.0", PORT)) as srv:
            conn, _ = srv.accept()
            total, start = 0, None
            with conn:
                while n := conn.recv_into(chunk):
                    start = start or time.perf_counter()
                    total += n
            print(f"LINK {total / (time.perf_counter() - start) / 1e9:.4f}")
        return
    deadline = time.monotonic() + 5
    while True:
        try:
            conn = socket.create_connection(("node2", PORT), 5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(chunk)


def link_goodput(seconds: float, rounds: int) -> list[float]:
    """GB/s of one TCP stream node1 -> node2, ``rounds`` times."""
    me = shlex.join([sys.executable, str(Path(__file__).resolve())])
    out = []
    for _ in range(rounds):
        recv = subprocess.Popen(["bash", str(VCLUSTER), "exec", "-n", "node2", "bash", "-c",
                                 f"{me} --link-worker recv"], stdout=subprocess.PIPE, text=True)
        on_cluster(f"{me} --link-worker send --seconds {seconds}")
        text, _ = recv.communicate(timeout=60)
        out.append(float(re.search(r"LINK ([\d.]+)", text).group(1)))
    return out


# ---- 3. chunkstore's remote tier ---------------------------------------------------------------------------


def chunkstore_worker(rows: int, batch: int, rounds: int, iters: int) -> None:
    """One rank per node: gathers of ``batch`` random rows that all live on other nodes, their rows moved by MPI
    (the default) and over the gloo group, against a bare gloo ``all_to_all_single`` moving the same bytes,
    interleaved round by round; rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from torchhpc.chunkstore import ChunkTensor
    from torchhpc.launcher import init_distributed

    info = init_distributed(backend="gloo", timeout=120)
    comm, rank, size = MPI.COMM_WORLD, info.rank, info.world_size
    dim = 128
    data = torch.randn(rows, dim, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(rank)
    row_bytes = dim * 4
    # equal splits, one of them to itself: the peers' share is the gather's remote bytes
    per = -(-batch * dim // (size - 1))
    send, recv = torch.empty(per * size), torch.empty(per * size)
    times: dict[str, list[float]] = {"mpi": [], "group": [], "a2a": []}
    with contextlib.ExitStack() as stack:  # both closed on the way out, also when a check fails
        # host tier only: every row is on its node's segment
        cts = {by: stack.enter_context(ChunkTensor((rows, dim), torch.float32, 0, row_transport=by))
               for by in ("mpi", "group")}
        for ct in cts.values():
            ct.load_from_tensor(data if rank == 0 else None)
            assert ct.topo.num_nodes == size, "one rank per node expected"
        theirs = cts["mpi"].split_index(torch.arange(rows)).remote.ids  # rows held by the other nodes
        for rnd in range(rounds + 1):
            for what in times:
                idx = theirs[torch.randint(len(theirs), (batch,), generator=gen)]
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    if what == "a2a":
                        dist.all_to_all_single(recv, send)
                    else:
                        got = cts[what].remote_index(idx)
                dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / iters
                if rnd:
                    times[what].append(dt)
                elif what != "a2a":
                    assert torch.equal(got, data[idx]), "remote rows differ"
    if rank == 0:
        remote = batch * row_bytes
        print("RESULT " + json.dumps({"batch": batch, "remote_bytes": remote,
                                      **{f"{k}_gbs": [remote / t / 1e9 for t in v] for k, v in times.items()}}),
              flush=True)
    dist.destroy_process_group()


# ---- the run -----------------------------------------------------------------------------------------------


PARTS = ("allreduce", "chunkstore", "rehearsal")  # what a rate runs after the link's goodput, in this order


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def run_rate(rate: str, args: argparse.Namespace, out_dir: Path) -> None:
    n = args.nodes
    tag = rate if n == 2 else f"{rate}-{n}nodes"
    subprocess.run(["bash", str(VCLUSTER), "link", rate], check=True, capture_output=True)
    print(f"\n## link: {rate}\n")
    link = link_goodput(2.0 if not args.quick else 1.0, 3)
    gbs = statistics.median(link)
    print(f"TCP goodput node1 -> node2, one stream: {spread(link)} GB/s (median [min-max] of {len(link)})\n")

    parts = args.parts.split(",")
    if "allreduce" in parts:
        all_reduce_table(rate, tag, args, out_dir)
    if "chunkstore" in parts:
        chunkstore_table(rate, gbs, args)
    if "rehearsal" in parts:
        rehearsal_tables(args)


def all_reduce_table(rate: str, tag: str, args: argparse.Namespace, out_dir: Path) -> None:
    n, on = args.nodes, f"1 rank on each of {args.nodes} nodes"
    max_bytes = args.max_bytes if rate == "none" else min(args.max_bytes, 16 << 20)
    plot = out_dir / f"multinode-busbw-{tag}.svg"
    data = out_dir / f"multinode-{tag}.json"  # `make docs-plots` draws the plot again from it
    table = on_cluster(mpiexec(["torchhpc", "bench", "allreduce", "--min-bytes", "8", "--max-bytes",
                                str(max_bytes), "--repeats", str(args.repeats), "--time-per-point",
                                str(args.time_per_point), "--json", str(data), "--plot", str(plot)], n))
    print(f"all_reduce, {on} (`torchhpc bench allreduce`):\n")
    print("\n".join(ln for ln in table.splitlines() if ln.startswith(("|", "#", " ")) or "busbw" in ln))
    print(f"\nbusbw plot: {plot.relative_to(ROOT) if plot.is_relative_to(ROOT) else plot}\n")


def chunkstore_table(rate: str, gbs: float, args: argparse.Namespace) -> None:
    n = args.nodes
    me = [sys.executable, str(Path(__file__).resolve())]
    print("| chunkstore remote gather | batch | remote MB/call | gather GB/s, rows by MPI | rows by gloo "
          "| gloo all_to_all GB/s | gather / link: MPI | gloo | a2a / link |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batches:
        res = on_cluster(mpiexec([*me, "--chunkstore-worker", "--rows", str(args.rows), "--batch", str(batch),
                                  "--rounds", str(args.repeats), "--iters", str(args.iters)], n))
        row = json.loads(re.search(r"^RESULT (.*)$", res, re.MULTILINE).group(1))
        m, g, a = (statistics.median(row[f"{k}_gbs"]) for k in ("mpi", "group", "a2a"))
        print(f"| {rate} | {batch} | {row['remote_bytes'] / 1e6:.2f} | {spread(row['mpi_gbs'])} | "
              f"{spread(row['group_gbs'])} | {spread(row['a2a_gbs'])} | {m / gbs:.2f} | {g / gbs:.2f} | "
              f"{a / gbs:.2f} |")
    print()


def rehearsal_tables(args: argparse.Namespace) -> None:
    n, on = args.nodes, f"1 rank on each of {args.nodes} nodes"
    quick = ["--quick"] if args.quick else []
    print(f"rehearsal remote fetch, {on} (`bench/rehearsal_transport.py --hosts {hosts(n)}`):\n")
    print(on_cluster(f"python bench/rehearsal_transport.py --hosts {hosts(n)} --ranks {n} {' '.join(quick)}"))
    for transport in ("mpi", "thallium"):
        print(f"rehearsal training-loop overhead, {on} (`bench/rehearsal.py --hosts {hosts(n)} "
              f"--transport {transport}`):\n")
        print(on_cluster(f"python bench/rehearsal.py --hosts {hosts(n)} --ranks {n} --transport {transport} "
                         f"{' '.join(quick)}"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="none,10gbit,1gbit", help="comma list of tc rates; none: unshaped")
    p.add_argument("--nodes", type=int, default=2, help="one rank on each of node1 .. nodeN (files get -Nnodes)")
    p.add_argument("--quick", action="store_true", help="fewer rounds and sizes (about a minute per rate)")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "bench",
                   help="where the SVGs go: a path every node sees (each node's /tmp is its own)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help="comma list of what to run after the link's goodput: " + ", ".join(PARTS))
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--batches", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--time-per-point", type=float, default=0.25)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--link-worker", choices=("send", "recv"), help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=2.0, help=argparse.SUPPRESS)
    p.add_argument("--chunkstore-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.link_worker:
        return link_worker(args.link_worker, args.seconds)
    if args.chunkstore_worker:
        return chunkstore_worker(args.rows, args.batch, args.rounds, args.iters)
    if args.quick:
        args.repeats, args.batches, args.max_bytes, args.time_per_point = 3, [4096], 4 << 20, 0.1
    if os.geteuid() != 0 or not (ROOT / "build" / "vcluster" / "nodes.list").exists():
        sys.exit("needs root and a virtual cluster: make cluster-up NODES=2")
    have = len((ROOT / "build" / "vcluster" / "nodes.list").read_text().split())
    if not 2 <= args.nodes <= have:
        sys.exit(f"--nodes {args.nodes}: the virtual cluster has {have} nodes (make cluster-up NODES=...)")
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        sys.exit(f"--parts: unknown {sorted(unknown)}; choose from {', '.join(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    busy = subprocess.run(["ps", "-eo", "pid=,pcpu=,comm="], capture_output=True, text=True).stdout.splitlines()
    hot = [" ".join(ln.split()[1:]) for ln in busy
           if ln.split() and float(ln.split()[1]) > 20 and int(ln.split()[0]) not in (os.getpid(), os.getppid())]
    print(f"# multinode benchmarks, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores; "
          f"busy processes before the run: {hot or 'none'}")
    try:
        for rate in args.rates.split(","):
            run_rate(rate, args, args.out)
    finally:
        subprocess.run(["bash", str(VCLUSTER), "link", "none"], capture_output=True)


if __name__ == "__main__":
    main()
