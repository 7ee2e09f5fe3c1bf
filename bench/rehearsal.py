"""Benchmark torchhpc.rehearsal: training-loop overhead and remote fetch throughput, each against a baseline.

1. Overhead: time per iteration of a data-parallel loop with a fixed-cost synthetic step,
   fed through ``RehearsalLoader`` (b new + up to r representatives drawn from all ranks),
   against the same loop fed ready-made batches of b+r samples without rehearsal.
2. Remote fetch: bytes of representatives read from other ranks per second of the worker's
   ``remote_fetch`` stage, against raw mpi4py one-sided ``Get`` s of the same bytes from the
   same window, in alternating rounds (see ``fetch_rounds`` for what is made equal).

The synthetic step sleeps: it costs wall time but no core, like a GPU step that leaves the
host CPU to the data pipeline.  A compute-bound step on this 2-core machine shared by 4
ranks would measure CPU contention between ranks rather than the cost of rehearsal.

    python bench/rehearsal.py --ranks 2 4          # launches mpiexec itself
    python bench/rehearsal.py --quick              # seconds: small samples, few iterations
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    """Runs on every rank under mpiexec; rank 0 prints one JSON line of results."""
    sys.path.insert(0, str(ROOT / "src"))
    import numpy as np
    import torch
    from mpi4py import MPI

    from torchhpc.rehearsal import AugmentedBatch, RehearsalBuffer, RehearsalLoader

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)  # how long a thread may keep the GIL from another
    shape = tuple(args.shape)
    b, r, k = args.batch, args.representatives, args.classes
    n = max(1, args.slots_per_rank // k)
    gen = torch.Generator().manual_seed(rank)

    def pool(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.rand((rows, *shape), generator=gen), torch.randint(0, k, (rows,), generator=gen))
                for _ in range(args.pool)]

    new_batches, full_batches = pool(b), pool(b + r)
    # The same new samples laid out by spare_rows_collate: b rows in tensors of b + r rows.
    spare_batches = []
    for x, y in new_batches:
        xs, ys = torch.empty((b + r, *shape)), torch.zeros(b + r, dtype=torch.int64)
        xs[:b], ys[:b] = x, y
        spare_batches.append((xs[:b], ys[:b], AugmentedBatch(xs, ys, torch.empty(b + r), None)))
    sync = np.zeros(256, dtype=np.float32)

    def step(split: dict[str, float]) -> None:
        """The fixed-cost "training step", then the gradient sync that keeps ranks in lock-step."""
        t0 = time.perf_counter()
        time.sleep(args.step_ms / 1e3)
        t1 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, sync, op=MPI.SUM)
        t2 = time.perf_counter()
        split["sleep"] += t1 - t0
        split["allreduce"] += t2 - t1

    def timed(batches, iters: int, split: dict[str, float]) -> float:
        """Seconds per iteration of the loop over ``batches``; ``split`` gets where the time went."""
        comm.Barrier()
        t0 = time.perf_counter()
        it = iter(batches)
        while True:
            t_next = time.perf_counter()
            batch = next(it, None)
            split["next"] += time.perf_counter() - t_next
            if batch is None:
                break
            assert batch[0].shape[0] == b + r
            step(split)
            del batch
        return (time.perf_counter() - t0) / iters

    def baseline(iters: int, split: dict[str, float]) -> float:
        return timed((full_batches[i % args.pool] for i in range(iters)), iters, split)

    buf = RehearsalBuffer(k, n, args.candidates, r, shape, seed=1, comm=comm, worker_niceness=args.worker_niceness,
                          transport=args.transport)
    # Fill every rank's buffer (outside the timings) so that every draw finds r representatives.
    for i in range(4 * k * n // args.candidates + 8):
        x, y = new_batches[i % args.pool]
        buf.accumulate(x, y)
        buf.wait()
        if int(buf.reservoir.fill.sum()) == k * n:
            break
    comm.Barrier()

    def rehearsal(iters: int, batches: list, split: dict[str, float]) -> float:
        stream = (batches[i % args.pool] for i in range(iters))
        return timed(RehearsalLoader(stream, buf), iters, split)

    base_t, reh_t, spare_t = [], [], []
    splits = {mode: dict.fromkeys(("next", "sleep", "allreduce"), 0.0) for mode in ("base", "reh", "spare")}
    spare_stats = None
    for _ in range(args.repeats):  # alternate to spread the machine's noise over all three
        base_t.append(baseline(args.iters, splits["base"]))
        buf.reset_timings()
        reh_t.append(rehearsal(args.iters, new_batches, splits["reh"]))
        loop_stats = buf.stats()
        buf.reset_timings()
        spare_t.append(rehearsal(args.iters, spare_batches, splits["spare"]))
        spare_stats = buf.stats()
    n_iters = args.iters * args.repeats
    splits = {mode: {k: 1e3 * v / n_iters for k, v in split.items()} for mode, split in splits.items()}

    # ---- remote fetch throughput, round by round against a raw one-sided Get of the same bytes.
    fetch = fetch_rounds(args, comm, buf, new_batches[0])
    comm.Barrier()
    buf.close()

    res = {
        "ranks": size,
        "baseline_ms": 1e3 * statistics.median(base_t),
        "rehearsal_ms": 1e3 * statistics.median(reh_t),
        "spare_ms": 1e3 * statistics.median(spare_t),
        "spare_stages_ms": spare_stats["timings_ms"],
        "stages_ms": loop_stats["timings_ms"],
        **fetch,
        "splits_ms": splits,
    }
    allres = comm.gather(res, root=0)
    if rank == 0:
        agg = dict(res)
        for key in ("baseline_ms", "rehearsal_ms", "spare_ms", "fetch_gbs", "raw_gbs", "raw_main_gbs"):
            agg[key] = statistics.mean(x[key] for x in allres)
        rr = sorted(x for res_ in allres for x in res_["round_ratios"])
        agg["round_ratio_quartiles"] = [rr[len(rr) // 4], rr[len(rr) // 2], rr[3 * len(rr) // 4]] if rr else []
        agg["next_max_ms"] = {mode: max(x["splits_ms"][mode]["next"] for x in allres) for mode in splits}
        print("RESULT " + json.dumps(agg), flush=True)


def fetch_rounds(args: argparse.Namespace, comm, buf, batch) -> dict:
    """Throughput of the buffer's remote fetch against raw ``MPI_Get`` s of the same bytes, in alternating rounds.

    Ours: the worker's ``remote_fetch`` stage (the Gets of the drawn records' label and sample
    fields, then ``Flush`` and ``Unlock`` per peer) for one-sample batches submitted on all ranks at
    once, so that the worker mostly fetches.  Raw: in the same round, on the same window (the
    buffer's storage), as many records as ours fetched, from peers and slots drawn uniformly
    (the distribution of our draws when every buffer is full), one contiguous ``Get`` of the
    sample bytes per record into consecutive rows.  Same epoch structure: a shared ``Lock`` on
    each peer, the peers' fill counts read and flushed (untimed, as in ours, where they are
    part of sampling), then the timed Gets and each peer's ``Flush`` and ``Unlock``.  Same thread context: the
    raw Gets run in a thread at the worker's niceness while the main thread waits, as ours do;
    ``raw_main_gbs`` is the same raw read from the main thread, for reference.  Both count the
    sample bytes only (ours reads the labels in that time too).  Every peer's window is read
    once in full beforehand, so that both find its pages mapped, as in a long run.
    """
    import threading

    import numpy as np
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    lay, win = buf.layout, buf.storage.win
    sample_bytes, sample_off = lay.samples[0].nbytes, lay.samples[0].offset
    num_slots = lay.num_slots
    peers = [p for p in range(size) if p != rank]
    out = {"fetch_gbs": 0.0, "raw_gbs": 0.0, "raw_main_gbs": 0.0, "fetch_bytes_per_iter": 0.0, "round_ratios": []}
    if not peers or win is None:
        return out
    dst = np.empty((buf.R + 1) * sample_bytes, dtype=np.uint8)
    fills = np.empty((len(peers), lay.num_classes), dtype=np.int64)
    chunk = 32
    tmp = np.empty(chunk * lay.record_bytes, dtype=np.uint8)
    win.Lock_all()  # map every page of every peer's storage once (steady state of a long run)
    for p in peers:
        for lo in range(0, num_slots, chunk):
            span = lay.record_offset(min(num_slots, lo + chunk)) - lay.record_offset(lo)
            win.Get(tmp[:span], p, target=(lay.record_offset(lo), span, MPI.BYTE))
            win.Flush(p)
    win.Unlock_all()
    rng = np.random.default_rng(rank)
    one_x, one_y = batch[0][:1], batch[1][:1]

    def raw_read(nrec: int) -> float:
        picks = [(int(rng.choice(peers)), lay.record_offset(int(rng.integers(0, num_slots))) + sample_off,
                  dst[j * sample_bytes : (j + 1) * sample_bytes]) for j in range(nrec)]
        for p in peers:
            win.Lock(p, MPI.LOCK_SHARED)
        for i, p in enumerate(peers):
            win.Get(fills[i], p, target=(0, fills[i].nbytes, MPI.BYTE))
        for p in peers:
            win.Flush(p)
        t0 = time.perf_counter()
        for peer, disp, piece in picks:
            win.Get(piece, peer, target=(disp, sample_bytes, MPI.BYTE))
        for p in peers:
            win.Flush(p)
            win.Unlock(p)
        return time.perf_counter() - t0

    def raw_in_thread(nrec: int) -> float:
        took = []

        def body() -> None:
            if buf.worker_niceness and sys.platform.startswith("linux"):
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), buf.worker_niceness))
            took.append(raw_read(nrec))

        t = threading.Thread(target=body)
        t.start()
        t.join()
        return took[0]

    ours_b = ours_s = raw_s = main_s = 0.0
    comm.Barrier()
    for it in range(args.fetch_iters + 2):  # 2 warm-up rounds, then timed ones
        before = buf.stats()
        comm.Barrier()  # all ranks fetch together, then all run the raw Gets together
        buf.accumulate(one_x, one_y)
        buf.wait()  # the worker is idle again: the window is free for the raw epochs below
        after = buf.stats()
        nrec = round((after["remote_bytes"] - before["remote_bytes"]) / (sample_bytes + 8))
        took = after["timing_totals_s"]["remote_fetch"] - before["timing_totals_s"]["remote_fetch"]
        nmax = comm.allreduce(nrec, op=MPI.MAX)
        comm.Barrier()
        t_raw = raw_in_thread(nrec) if nrec else 0.0
        comm.Barrier()
        t_main = raw_read(nrec) if nrec else 0.0
        if it >= 2 and nmax:
            ours_b, ours_s, raw_s, main_s = ours_b + nrec * sample_bytes, ours_s + took, raw_s + t_raw, main_s + t_main
            if nrec:
                out["round_ratios"].append(t_raw / took)
    out.update(fetch_gbs=ours_b / ours_s / 1e9 if ours_s else 0.0, raw_gbs=ours_b / raw_s / 1e9 if raw_s else 0.0,
               raw_main_gbs=ours_b / main_s / 1e9 if main_s else 0.0, fetch_bytes_per_iter=ours_b / args.fetch_iters)
    return out


def launch(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from torchhpc.runtime.mpirun import across_hosts, available_cores, local_job_env, mpiexec_argv

    env = local_job_env(oversubscribed=False)  # (yield-when-idle is added per launch, only when oversubscribed)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_osc", "^ucx")  # no UCX network here; silences its failed probe
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    rows = []
    for nranks in args.ranks:
        cmd = mpiexec_argv(nranks, [sys.executable, str(Path(__file__).resolve()), "--worker",
                                    *worker_args(args)], extra=across_hosts(args.hosts, nranks, env))
        proc = subprocess.run(cmd, env=local_job_env(env, oversubscribed=nranks > available_cores()),
                              capture_output=True, text=True, timeout=args.timeout)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"benchmark at {nranks} ranks failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                     f"\n{proc.stderr[-3000:]}")
        rows.append(json.loads(line[len("RESULT "):]))
    shape = "x".join(map(str, args.shape))
    print(f"b={args.batch} new + r={args.representatives} representatives of {shape} float32, "
          f"C={args.candidates}, "
          f"{args.slots_per_rank} slots/rank, step {args.step_ms} ms (sleep) + Allreduce, "
          f"{args.iters} iters x {args.repeats} repeats (median)"
          + f", worker niceness {args.worker_niceness}, transport {args.transport}"
          + (f", GIL switch interval {args.switch_interval * 1e3:g} ms" if args.switch_interval else ""))
    print()
    print("| ranks | baseline ms/iter | rehearsal ms/iter | overhead | with spare rows ms/iter | overhead "
          "| remote fetch GB/s | raw Get GB/s | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        over = row["rehearsal_ms"] / row["baseline_ms"] - 1
        spare = row["spare_ms"] / row["baseline_ms"] - 1
        ratio = row["fetch_gbs"] / row["raw_gbs"] if row["raw_gbs"] else float("nan")
        raw = f"{row['raw_gbs']:.2f}" if row["raw_gbs"] else "n/a (1 rank or no MPI window)"
        print(f"| {row['ranks']} | {row['baseline_ms']:.1f} | {row['rehearsal_ms']:.1f} | {100 * over:+.1f}% | "
              f"{row['spare_ms']:.1f} | {100 * spare:+.1f}% | {row['fetch_gbs']:.2f} | {raw} | {ratio:.2f} |")
    print()
    for row in rows:
        q = ", ".join(f"{x:.2f}" for x in row["round_ratio_quartiles"])
        print(f"{row['ranks']} ranks: fetch ratio per rank and round, quartiles {q}; raw Get from the main "
              f"thread {row['raw_main_gbs']:.2f} GB/s; {row['fetch_bytes_per_iter'] / 1e6:.1f} MB fetched per round")
    print("worker stages (rank 0, mean ms per iteration): ")
    for row in rows:
        for name, key in (("copied", "stages_ms"), ("spare rows", "spare_stages_ms")):
            stages = ", ".join(f"{k} {v:.2f}" for k, v in row[key].items())
            print(f"  {row['ranks']} ranks, {name}: {stages}")
    print("training thread (rank 0, mean ms per iteration: next batch / sleep / Allreduce):")
    for row in rows:
        parts = ", ".join(f"{mode} {v['next']:.2f} / {v['sleep']:.2f} / {v['allreduce']:.2f}"
                          for mode, v in row["splits_ms"].items())
        print(f"  {row['ranks']} ranks: {parts}; next batch on the slowest rank: "
              + ", ".join(f"{mode} {v:.2f}" for mode, v in row["next_max_ms"].items()))


def worker_args(args: argparse.Namespace) -> list[str]:
    return ["--batch", str(args.batch), "--representatives", str(args.representatives),
            "--candidates", str(args.candidates), "--classes", str(args.classes),
            "--slots-per-rank", str(args.slots_per_rank), "--shape", *map(str, args.shape),
            "--step-ms", str(args.step_ms), "--iters", str(args.iters), "--repeats", str(args.repeats),
            "--fetch-iters", str(args.fetch_iters), "--pool", str(args.pool),
            "--switch-interval", str(args.switch_interval), "--worker-niceness", str(args.worker_niceness),
            "--transport", args.transport]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--quick", action="store_true", help="small samples and few iterations (seconds)")
    p.add_argument("--batch", type=int, default=56)
    p.add_argument("--representatives", type=int, default=7)
    p.add_argument("--candidates", type=int, default=14)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--slots-per-rank", type=int, default=3000)
    p.add_argument("--shape", type=int, nargs="+", default=[3, 224, 224])
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fetch-iters", type=int, default=60)
    p.add_argument("--pool", type=int, default=2, help="distinct synthetic batches cycled through")
    p.add_argument("--switch-interval", type=float, default=0.0,
                   help="sys.setswitchinterval for every rank (0: Python's default, 5 ms)")
    p.add_argument("--worker-niceness", type=int, default=10,
                   help="RehearsalBuffer(worker_niceness=...): the default 10, or 0 for the process's own priority")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--hosts", default=None,
                   help="spread each job's ranks evenly over these hosts (comma list; mpiexec --host), e.g. the "
                        "virtual cluster's node1,node2")
    p.add_argument("--transport", default="auto", choices=("auto", "mpi", "thallium"),
                   help="RehearsalBuffer(transport=...); the raw Get comparison needs the MPI transport's window")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.shape, args.slots_per_rank, args.iters, args.repeats = [3, 32, 32], 200, 10, 1
        args.fetch_iters, args.step_ms = 20, 20.0
        if "--ranks" not in sys.argv:
            args.ranks = [2]
    if args.worker:
        worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
