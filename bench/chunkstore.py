"""Benchmark torchhpc.chunkstore: gather bandwidth per tier, PSS shared vs private, sampling throughput.

Every figure is reported next to a baseline measured in the same run:

- random-row gathers of 128-dim float32 rows from each tier (this rank's device chunk, another
  local rank's chunk, the node-shared host tier) versus ``torch.index_select`` on an ordinary
  in-process tensor, at 1, 2 and 4 local ranks gathering at the same time (aggregate = sum over
  ranks); rows of other "nodes" (emulated, gloo) versus a bare ``all_to_all_single`` of the
  same bytes, the transport's own limit;
- resident memory per rank (PSS, ``psutil.Process().memory_full_info().pss``) with the host
  tier shared versus every rank holding its own copy;
- neighbor-sampling throughput (sampled edges/s) versus straightforward torch reference
  samplers: per mode a per-seed loop (``randperm`` / ``randint`` / ``multinomial``), and for
  uniform sampling without replacement also a vectorised sort-by-random-key sampler.

    flock /tmp/torchhpc-bench.lock python bench/chunkstore.py --quick
    flock /tmp/torchhpc-bench.lock python bench/chunkstore.py          # 1M rows, 1M-node graph

Timings on a shared, oversubscribed machine are noisy: read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

DIM = 128


def _time(fn, min_time: float, max_reps: int = 50) -> float:
    """Median seconds of ``fn()`` over repetitions filling about ``min_time``."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _time_pair(f_base, f_new, min_time: float, max_reps: int = 60) -> tuple[float, float]:
    """Median seconds of two functions timed alternately, so load changes hit both alike."""
    f_base()
    f_new()
    tb: list[float] = []
    tn: list[float] = []
    start = time.perf_counter()
    while len(tb) < 5 or (time.perf_counter() - start < 2 * min_time and len(tb) < max_reps):
        for f, acc in ((f_base, tb), (f_new, tn)):
            t = time.perf_counter()
            f()
            acc.append(time.perf_counter() - t)
    return statistics.median(tb), statistics.median(tn)


def _pss() -> int:
    import psutil

    return psutil.Process().memory_full_info().pss


def worker(args: argparse.Namespace) -> None:
    """Runs on every rank under mpiexec; rank 0 prints one JSON line with the results."""
    import torch
    from mpi4py import MPI

    from torchhpc.chunkstore import ChunkTensor
    from torchhpc.launcher import init_distributed

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    rows = args.rows
    rb = DIM * 4
    g = torch.Generator().manual_seed(rank)
    out: dict = {"ranks": size, "rows": rows, "gather": [], "pss": {}}

    # --- PSS: shared host tier (every row in it) vs a private copy per rank ---------------------
    gc.collect()
    comm.Barrier()
    pss0 = _pss()
    shared = ChunkTensor((rows, DIM), torch.float32, 0)
    view = shared.host_view()
    share = -(-rows // size)
    lo, hi = rank * share, min(rows, (rank + 1) * share)
    view[lo:hi] = torch.randn(hi - lo, DIM, generator=g)  # every rank fills its share, in place
    comm.Barrier()
    float(view.sum())  # touch every page, as gathers over the whole tensor eventually do
    comm.Barrier()
    pss_shared = _pss() - pss0
    private = torch.randn(rows, DIM, generator=g)  # the alternative: each rank holds its own copy
    comm.Barrier()
    pss_private = _pss() - pss0 - pss_shared
    out["pss"] = {"shared_per_rank": comm.allgather(pss_shared),
                  "private_per_rank": comm.allgather(pss_private), "tensor_bytes": rows * rb}
    shared.close()
    del view, shared
    gc.collect()

    # --- gather bandwidth per tier -------------------------------------------------------------
    cap = rows * rb // (2 * size)  # half of the rows in device chunks, half in the host tier
    ct = ChunkTensor((rows, DIM), torch.float32, cap)
    dev = ct.device_view()
    dev.copy_(private[ct.device_ids()])
    if ct.topo.local_rank == 0:
        ct.host_view().copy_(private[ct.host_ids()])
    comm.Barrier()
    peer_ids = comm.allgather(ct.device_ids())
    tiers = {"local device": ct.device_ids(), "host": ct.host_ids(), "all (mixed)": torch.arange(rows)}
    if size > 1:
        tiers["other device"] = peer_ids[(rank + 1) % size]
    remote = None
    if size > 1:
        init_distributed(backend="gloo", timeout=300)
        remote = ChunkTensor((rows, DIM), torch.float32, 0, ranks_per_node=size // 2)
        if remote.topo.local_rank == 0:
            remote.host_view().copy_(private[remote.host_ids()])
        comm.Barrier()
        other = remote.topo.node_ranks[1 - remote.topo.node][0]
        tiers["remote node"] = comm.allgather(remote.host_ids())[other]
    if args.tiers:
        tiers = {k: v for k, v in tiers.items() if any(t in k for t in args.tiers)}
    for batch in args.batches:
        for tier, pool in tiers.items():
            idx = pool[torch.randint(0, len(pool), (batch,), generator=g)]
            store = remote if tier.startswith("remote") else ct
            buf = torch.empty(batch, DIM)
            comm.Barrier()
            if store is remote:
                # Collective: every rank runs the same repetitions, alternating the ChunkTensor gather with
                # the transport's own limit, a bare all_to_all_single moving the same bytes to the same peer.
                import torch.distributed as dist

                peer = remote.topo.node_ranks[1 - remote.topo.node][remote.topo.local_rank]
                splits = [batch * rb if r == peer else 0 for r in range(size)]
                send = torch.empty(batch * rb, dtype=torch.uint8)
                recv = torch.empty(batch * rb, dtype=torch.uint8)
                tb, tc = [], []
                reps = 16 if batch <= 10_000 else 8 if batch <= 100_000 else 5
                for _ in range(reps):
                    comm.Barrier()
                    t0 = time.perf_counter()
                    dist.all_to_all_single(recv, send, splits, splits)
                    tb.append(time.perf_counter() - t0)
                    comm.Barrier()
                    t0 = time.perf_counter()
                    store.index(idx, out=buf)
                    tc.append(time.perf_counter() - t0)
                t_base, t_ct = statistics.median(tb[1:]), statistics.median(tc[1:])
            else:
                t_base, t_ct = _time_pair(
                    lambda idx=idx, buf=buf: torch.index_select(private, 0, idx, out=buf),
                    lambda idx=idx, store=store, buf=buf: store.index(idx, out=buf), args.min_time)
            comm.Barrier()
            both = comm.gather((t_ct, t_base), root=0)
            if rank == 0:
                gbs = [batch * rb / t / 1e9 for t, _ in both]
                base = [batch * rb / b / 1e9 for _, b in both]
                out["gather"].append({"tier": tier, "batch": batch, "GBps_per_rank": statistics.mean(gbs),
                                      "GBps_aggregate": sum(gbs), "baseline_GBps_aggregate": sum(base),
                                      "baseline": "all_to_all_single" if store is remote else "index_select",
                                      "ratio": sum(gbs) / sum(base)})
    ct.close()
    if remote is not None:
        remote.close()
        import torch.distributed as dist

        dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


# --------------------------------------------------------------------------- sampling (one process)
def _power_law_csc(n: int, avg_degree: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    w = (1.0 - torch.rand(n, generator=g, dtype=torch.float64)) ** (-1 / 1.5)
    e = n * avg_degree
    dst = torch.sort(torch.multinomial(w.float(), e, replacement=True, generator=g)).values
    src = torch.multinomial(w.float(), e, replacement=True, generator=g)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.bincount(dst, minlength=n), 0)])
    return indptr, src


def _ref_loop(seeds, indptr, indices, k, replace, probs, gen):
    """Reference: the straightforward sampler, one torch call per seed (randperm / randint / multinomial)."""
    import torch

    rows, cols = [], []
    for s in seeds.tolist():
        a, b = int(indptr[s]), int(indptr[s + 1])
        if b == a:
            continue
        if probs is None:
            pick = torch.randint(0, b - a, (k,), generator=gen) if replace else \
                torch.randperm(b - a, generator=gen)[:k]
        else:
            w = probs[a:b]
            n = int((w > 0).sum())
            if n == 0:
                continue
            pick = torch.multinomial(w, k if replace else min(k, n), replacement=replace, generator=gen)
        rows.append(indices[pick + a])
        cols.append(torch.full((len(pick),), s))
    return torch.cat(rows), torch.cat(cols)


def _ref_sort(seeds, indptr, indices, k, gen):
    """Reference: vectorised uniform sampling without replacement, a random key per edge, sort, first k."""
    import torch

    start, end = indptr[seeds], indptr[seeds + 1]
    deg = end - start
    seg = torch.repeat_interleave(torch.arange(len(seeds)), deg)
    first = torch.cumsum(deg, 0) - deg
    eids = start[seg] + torch.arange(len(seg)) - first[seg]
    key = seg.double() + torch.rand(len(seg), generator=gen, dtype=torch.float64) * 0.5
    order = torch.argsort(key)
    keep = (torch.arange(len(seg)) - first[seg]) < k
    return indices[eids[order][keep]], seeds[seg[order][keep]]


def sampling_bench(args: argparse.Namespace) -> list[dict]:
    import torch

    from torchhpc.chunkstore import ChunkTensor, sample_neighbors

    torch.set_num_threads(1)
    indptr, indices = _power_law_csc(args.graph_nodes, 20, 0)
    probs = torch.rand(len(indices), generator=torch.Generator().manual_seed(1))
    seeds = torch.randint(0, args.graph_nodes, (args.seeds,), generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    k = 10
    loop_seeds = seeds[: max(1, len(seeds) // 10)]
    res = []
    t = _time(lambda: _ref_sort(seeds, indptr, indices, k, gen), args.min_time, 10)
    sort_rate = len(_ref_sort(seeds, indptr, indices, k, gen)[0]) / t
    with ChunkTensor(len(indptr), torch.int64, 0) as cp, ChunkTensor(len(indices), torch.int64, 0) as ci, \
            ChunkTensor(len(probs), torch.float32, 0) as cw:
        cp.load_from_tensor(indptr)
        ci.load_from_tensor(indices)
        cw.load_from_tensor(probs)
        for weighted in (False, True):
            for rep in (False, True):
                pr = probs if weighted else None

                def ref(rep=rep, pr=pr):
                    return _ref_loop(loop_seeds, indptr, indices, k, rep, pr, gen)

                ref_rate = len(ref()[0]) / _time(ref, args.min_time, 5)
                mode = f"{'weighted' if weighted else 'uniform'}, {'with' if rep else 'no'} replacement"
                for where, ip, ix, pw in (("tensors", indptr, indices, pr),
                                          ("ChunkTensors", cp, ci, cw if weighted else None)):
                    def run(ip=ip, ix=ix, pw=pw, rep=rep):
                        return sample_neighbors(seeds, ip, ix, k, rep, pw, seed=0)

                    rate = len(run()[0]) / _time(run, args.min_time, 10)
                    res.append({"sampler": f"{mode} ({where})", "edges_per_s": rate, "loop_ref_edges_per_s":
                                ref_rate, "vs_loop_ref": rate / ref_rate,
                                "vs_sort_ref": rate / sort_rate if not weighted and not rep else None})
    res.append({"sampler": "reference: vectorised sort by random key (uniform, no replacement)",
                "edges_per_s": sort_rate, "loop_ref_edges_per_s": None, "vs_loop_ref": None,
                "vs_sort_ref": 1.0})
    return res


# --------------------------------------------------------------------------- driver
def run_ranks(n: int, args: argparse.Namespace) -> dict:
    from torchhpc.runtime.mpirun import available_cores, local_job_env, mpiexec_argv

    env = local_job_env(oversubscribed=n > available_cores())
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    argv = [sys.executable, __file__, "--worker", "--rows", str(args.rows), "--min-time", str(args.min_time),
            "--batches", *map(str, args.batches), *(["--tiers", *args.tiers] if args.tiers else [])]
    proc = subprocess.run(mpiexec_argv(n, argv), capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{n}-rank worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                       f"{proc.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description="chunkstore gather / memory / sampling benchmark")
    p.add_argument("--quick", action="store_true", help="small sizes, runs in seconds")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--ranks", type=int, nargs="+", default=None)
    p.add_argument("--min-time", type=float, default=None)
    p.add_argument("--tiers", nargs="+", default=None, help="only tiers whose name contains one of these")
    p.add_argument("--no-sampling", action="store_true", help="skip the sampling benchmark")
    p.add_argument("--graph-nodes", type=int, default=None)
    p.add_argument("--seeds", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    q = args.quick
    args.rows = args.rows or (100_000 if q else 1_000_000)
    args.batches = args.batches or ([1000, 100_000] if q else [1000, 10_000, 100_000, 1_000_000])
    args.ranks = args.ranks or ([1, 2] if q else [1, 2, 4])
    args.min_time = args.min_time if args.min_time is not None else (0.05 if q else 0.3)
    args.graph_nodes = args.graph_nodes or (50_000 if q else 1_000_000)
    args.seeds = args.seeds or (2000 if q else 20_000)
    if args.worker:
        worker(args)
        return
    runs = [run_ranks(n, args) for n in args.ranks]
    results = {"argv": sys.argv, "runs": runs, "sampling": [] if args.no_sampling else sampling_bench(args)}
    print(f"## gathers of {DIM}-dim float32 rows from a {args.rows}-row ChunkTensor "
          f"(ratio = ChunkTensor / torch.index_select on a private tensor, same ranks, same run)\n")
    print("| local ranks | tier | batch | GB/s per rank | aggregate GB/s | baseline aggregate GB/s "
          "| ratio |")
    print("|---|---|---|---|---|---|---|")
    for run in results["runs"]:
        for r in run["gather"]:
            print(f"| {run['ranks']} | {r['tier']} | {r['batch']} | {r['GBps_per_rank']:.2f} | "
                  f"{r['GBps_aggregate']:.2f} | {r['baseline_GBps_aggregate']:.2f} ({r['baseline']}) "
                  f"| {r['ratio']:.2f} |")
    print("\n## resident memory (PSS) per rank: host tier shared vs a private copy per rank\n")
    print("| local ranks | tensor MiB | shared: PSS MiB per rank | shared: node total MiB | "
          "private: PSS MiB per rank | private: node total MiB |")
    print("|---|---|---|---|---|---|")
    for run in results["runs"]:
        m = run["pss"]
        sh, pr = m["shared_per_rank"], m["private_per_rank"]
        print(f"| {run['ranks']} | {m['tensor_bytes'] / 2**20:.0f} | {statistics.mean(sh) / 2**20:.0f} | "
              f"{sum(sh) / 2**20:.0f} | {statistics.mean(pr) / 2**20:.0f} | {sum(pr) / 2**20:.0f} |")
    print(f"\n## neighbor sampling, fanout 10, {args.seeds} seeds, power-law graph of {args.graph_nodes} "
          f"nodes and {20 * args.graph_nodes} edges (one process)\n")
    print("| sampler | sampled edges/s | per-seed loop reference, edges/s | ratio to loop | "
          "ratio to vectorised sort |")
    print("|---|---|---|---|---|")

    def fmt(v, spec):
        return "" if v is None else format(v, spec)

    for r in results["sampling"]:
        print(f"| {r['sampler']} | {r['edges_per_s']:.3g} | {fmt(r['loop_ref_edges_per_s'], '.3g')} | "
              f"{fmt(r['vs_loop_ref'], '.1f')} | {fmt(r['vs_sort_ref'], '.2f')} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
