"""Benchmark the remote fetch of torchhpc.rehearsal: Thallium transport vs MPI transport vs raw MPI ``Get``.

On every rank, two buffers of the same layout (``transport="mpi"`` and ``transport="thallium"``) are
filled with the same records.  Each round, all ranks together hand each buffer a one-sample batch (so
the worker mostly fetches ``R`` representatives drawn from all ranks) and the worker's ``remote_fetch``
stage is timed; then, in the same round, the main thread reads as many records (label + sample
fields, one ``MPI_Get`` each, random peers and slots) from the MPI buffer's window inside a
shared ``Lock`` per peer, then each peer's ``Flush`` and ``Unlock`` (the buffer's own epoch): the
floor of what one-sided MPI costs here.  Throughput is remote bytes per second of that stage;
ratios are per rank and round against the MPI transport.

    python bench/rehearsal_transport.py --ranks 2 4
    python bench/rehearsal_transport.py --quick
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
    """Runs on every rank under mpiexec; rank 0 prints one JSON line per sample shape."""
    sys.path.insert(0, str(ROOT / "src"))
    from mpi4py import MPI

    for shape in args.shapes:
        one_shape(args, MPI.COMM_WORLD, tuple(int(s) for s in shape.split("x")))


def one_shape(args: argparse.Namespace, comm, shape: tuple[int, ...]) -> None:  # noqa: ANN001
    """The three fetches, round by round, for samples of ``shape``."""
    import numpy as np
    import torch
    from mpi4py import MPI

    from torchhpc.rehearsal import RehearsalBuffer

    rank, size = comm.Get_rank(), comm.Get_size()
    k, r = args.classes, args.representatives
    n = max(1, args.slots_per_rank // k)
    gen = torch.Generator().manual_seed(rank)
    bufs = {t: RehearsalBuffer(k, n, args.candidates, r, shape, seed=1, comm=comm, transport=t,
                               start_delay=0.0, worker_niceness=args.worker_niceness) for t in ("mpi", "thallium")}
    x = torch.rand((args.candidates, *shape), generator=gen)
    for _ in range(4 * k * n // args.candidates + 8):  # fill (untimed): every draw finds r records
        y = torch.randint(0, k, (args.candidates,), generator=gen)
        for buf in bufs.values():
            buf.accumulate(x, y)
            buf.wait()
        if all(int(b.reservoir.fill.sum()) == k * n for b in bufs.values()):
            break
    comm.Barrier()
    lay, win = bufs["mpi"].layout, bufs["mpi"].storage.win
    spans = [(f.offset, f.nbytes) for f in (lay.label, lay.samples[0])]
    peers = [p for p in range(size) if p != rank]
    dst = [np.empty((r, nb), dtype=np.uint8) for _, nb in spans]
    rng = np.random.default_rng(rank)

    def raw(nrec: int) -> float:
        picks = [(int(rng.choice(peers)), lay.record_offset(int(rng.integers(0, lay.num_slots))))
                 for _ in range(nrec)]
        for p in peers:
            win.Lock(p, MPI.LOCK_SHARED)
        t0 = time.perf_counter()
        for j, (p, base) in enumerate(picks):
            for d, (off, nb) in zip(dst, spans, strict=True):
                win.Get(d[j], p, target=(base + off, nb, MPI.BYTE))
        for p in peers:
            win.Flush(p)
            win.Unlock(p)
        return time.perf_counter() - t0

    totals = {"mpi": [0, 0.0], "thallium": [0, 0.0], "raw": [0, 0.0]}
    ratios: dict[str, list[float]] = {"thallium": [], "raw": []}
    one_x, one_y = x[:1], torch.zeros(1, dtype=torch.int64)
    for it in range(args.rounds + 2):  # 2 warm-up rounds
        got = {}
        for t, buf in bufs.items():
            before = buf.stats()
            comm.Barrier()
            buf.accumulate(one_x, one_y)
            buf.wait()
            after = buf.stats()
            got[t] = (after["remote_bytes"] - before["remote_bytes"],
                      after["timing_totals_s"]["remote_fetch"] - before["timing_totals_s"]["remote_fetch"])
        nrec = round(got["mpi"][0] / (lay.label.nbytes + lay.samples[0].nbytes))
        comm.Barrier()
        got["raw"] = (nrec * (lay.label.nbytes + lay.samples[0].nbytes), raw(nrec) if nrec and peers else 0.0)
        if it < 2:
            continue
        for t, (nbytes, took) in got.items():
            totals[t][0] += nbytes
            totals[t][1] += took
        if all(got[t][0] and got[t][1] for t in got):
            base = got["mpi"][0] / got["mpi"][1]
            for t in ratios:
                ratios[t].append(got[t][0] / got[t][1] / base)
    comm.Barrier()
    for buf in bufs.values():
        buf.close()
    res = {t: (nb / s / 1e9 if s else 0.0) for t, (nb, s) in totals.items()}
    every = comm.gather((res, ratios), root=0)
    if rank == 0:
        row = {"ranks": size, "shape": list(shape), "record_bytes": lay.record_bytes,
               "rounds": args.rounds, "representatives": r}
        for t in totals:
            row[f"{t}_gbs"] = statistics.mean(e[0][t] for e in every)
        for t in ratios:
            rr = sorted(x for e in every for x in e[1][t])
            row[f"{t}_ratio_q"] = [rr[len(rr) // 4], rr[len(rr) // 2], rr[3 * len(rr) // 4]] if rr else []
        print("RESULT " + json.dumps(row), flush=True)


def launch(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from torchhpc.runtime.mpirun import across_hosts, available_cores, local_job_env, mpiexec_argv

    env = local_job_env(oversubscribed=False)  # (yield-when-idle is added per launch, only when oversubscribed)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_osc", "^ucx")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    rows = []
    for nranks in args.ranks:
        cmd = mpiexec_argv(nranks, [sys.executable, str(Path(__file__).resolve()), "--worker", *worker_args(args)],
                           extra=across_hosts(args.hosts, nranks, env))
        proc = subprocess.run(cmd, env=local_job_env(env, oversubscribed=nranks > available_cores()),
                              capture_output=True, text=True, timeout=args.timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"benchmark at {nranks} ranks failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                     f"\n{proc.stderr[-3000:]}")
        rows += [json.loads(ln[len("RESULT "):]) for ln in lines]
    print(f"R={args.representatives} representatives drawn from all ranks per fetch, {args.slots_per_rank} slots/rank, "
          f"{args.rounds} rounds (+2 warm-up); GB/s = remote bytes / remote_fetch time, mean over ranks; "
          "ratio = per rank and round vs the MPI transport, quartiles")
    print()
    print("| ranks | sample | record | MPI transport GB/s | Thallium GB/s | Thallium / MPI | raw MPI Get GB/s "
          "| raw Get / MPI |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        q = {t: " / ".join(f"{x:.2f}" for x in row[f"{t}_ratio_q"]) for t in ("thallium", "raw")}
        print(f"| {row['ranks']} | {'x'.join(map(str, row['shape']))} f32 | {row['record_bytes'] / 1e3:.1f} kB | "
              f"{row['mpi_gbs']:.2f} | {row['thallium_gbs']:.2f} | {q['thallium']} | {row['raw_gbs']:.2f} "
              f"| {q['raw']} |")


def worker_args(args: argparse.Namespace) -> list[str]:
    return ["--representatives", str(args.representatives), "--candidates", str(args.candidates),
            "--classes", str(args.classes), "--slots-per-rank", str(args.slots_per_rank),
            "--rounds", str(args.rounds), "--worker-niceness", str(args.worker_niceness), "--shapes", *args.shapes]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--quick", action="store_true", help="small samples and few rounds (seconds)")
    p.add_argument("--representatives", type=int, default=16)
    p.add_argument("--candidates", type=int, default=16)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--slots-per-rank", type=int, default=200)
    p.add_argument("--shapes", nargs="+", default=["3x32x32", "3x224x224"],
                   help="sample shapes, e.g. 3x32x32 (CIFAR) 3x224x224 (ImageNet)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--worker-niceness", type=int, default=10, help="RehearsalBuffer(worker_niceness=...)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--hosts", default=None,
                   help="spread each job's ranks evenly over these hosts (comma list; mpiexec --host), e.g. the "
                        "virtual cluster's node1,node2")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.shapes, args.slots_per_rank, args.rounds = ["3x32x32"], 60, 6
        if "--ranks" not in sys.argv:
            args.ranks = [2]
    if args.worker:
        worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
