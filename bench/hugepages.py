"""Huge pages for CPU tensors: all-reduce and first-touch cost of torch's memory with and without
``THP_MEM_ALLOC_ENABLE``, against numpy's memory with and without its madvise.

Two ways to run it::

    mpiexec -n 2 python bench/hugepages.py         # one job, torch's memory as this environment has it
    python bench/hugepages.py --jobs 4 --rounds 7  # driver: jobs with THP_MEM_ALLOC_ENABLE=0 and =1, alternating

In a job every rank allocates float32 buffers of 1, 16 and 64 MiB from torch (``torch.empty`` + ``fill_``), from
numpy (``np.empty`` + ``fill``, madvised >= 4 MiB) and from numpy with its madvise off, and times an in-place sum
all-reduce on each through mpi4py (``comm.Allreduce(MPI.IN_PLACE, ...)``; torch's through ``tensor.numpy()``) and
through the ``accl`` backend (``dist.all_reduce``; numpy's through ``torch.from_numpy``).  Rounds interleave all
of them in rotated order; a round's time is the slowest rank's mean over its calls.  Rank 0 then times the first
touch of a fresh 64 MiB buffer of each kind.  Every buffer's huge pages are read from ``/proc/self/smaps``.
torch reads the variable once per process, hence the driver's separate jobs; it waits for an idle machine
before each job and reruns a job during which other processes used more than ``--max-foreign`` of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = (1 << 20, 16 << 20, 64 << 20)
MEMORIES = ["torch", "numpy", "numpy-4k"]  # torch.empty; np.empty (madvised >= 4 MiB); np.empty not madvised
ITERS = {1 << 20: 200, 16 << 20: 30, 64 << 20: 8}
ALLOC_BYTES = 64 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per job")
    ap.add_argument("--jobs", type=int, default=4, help="driver: jobs per setting of THP_MEM_ALLOC_ENABLE")
    ap.add_argument("--alloc-rounds", type=int, default=7, help="first-touch timings of 64 MiB per job")
    ap.add_argument("--calls", default="mpi4py,accl", help="subset of mpi4py,accl: the all-reduce timed")
    ap.add_argument("--json", action="store_true", help="job: print one JSON line (rank 0) instead of a table")
    ap.add_argument("--out", default=None, help="driver: also write every job's raw results here (JSON)")
    ap.add_argument("--max-foreign", type=float, default=0.1,
                    help="driver: run a job again when other processes used more than this fraction of the machine")
    ap.add_argument("--retries", type=int, default=3, help="driver: at most this many reruns of a job")
    ap.add_argument("--max-wait", type=float, default=600.0,
                    help="driver: seconds to wait for an idle machine before each job")
    return ap.parse_args(argv)


def _under_mpi() -> bool:
    return any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PALS_RANKID"))


# ---------------------------------------------------------------------------------------------- one job


def _buffers(mem: str, nbytes: int):
    """A written float32 buffer of ``nbytes`` from ``mem``'s allocator (torch, numpy, numpy without madvise)."""
    import numpy as np
    import torch
    from numpy._core.multiarray import _set_madvise_hugepage

    if mem == "torch":
        return torch.empty(nbytes // 4, dtype=torch.float32).fill_(0.0)
    was = _set_madvise_hugepage(mem == "numpy")
    try:
        a = np.empty(nbytes // 4, dtype=np.float32)
    finally:
        _set_madvise_hugepage(was)
    a.fill(0.0)
    return a


def _job(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from mpi4py import MPI

    sys.path.insert(0, SRC)
    from torchhpc.runtime.hugepages import huge_kib, kernel_setting, torch_thp_alloc

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    calls = [c for c in args.calls.split(",") if c]
    thp = torch_thp_alloc()  # latches torch's reading of the variable, before any tensor
    if "accl" in calls:
        import torch.distributed as dist

        import torchhpc.accl  # noqa: F401  (registers the backend)

        dist.init_process_group("accl")

    bufs = {(mem, n): _buffers(mem, n) for n in SIZES for mem in MEMORIES}
    views = {key: (b.numpy() if isinstance(b, torch.Tensor) else b) for key, b in bufs.items()}
    tensors = {key: (b if isinstance(b, torch.Tensor) else torch.from_numpy(b)) for key, b in bufs.items()}

    def call(kind: str, key: tuple[str, int]) -> None:
        if kind == "accl":
            torch.distributed.all_reduce(tensors[key])
        else:
            comm.Allreduce(MPI.IN_PLACE, views[key], MPI.SUM)

    huge = {f"{mem}/{n}": huge_kib(views[mem, n].ctypes.data, n) for mem, n in bufs}
    pairs = [(c, mem) for c in calls for mem in MEMORIES]
    times: dict[str, list[float]] = {f"{c} {mem}/{n}": [] for c, mem in pairs for n in SIZES}
    for c, mem in pairs:  # warm-up: MPI's own buffers, accl's plans
        for n in SIZES:
            call(c, (mem, n))
    for r in range(args.rounds):
        for n in SIZES:
            for c, mem in pairs[r % len(pairs):] + pairs[:r % len(pairs)]:
                k = ITERS[n]
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    call(c, (mem, n))
                dt = (time.perf_counter() - t0) / k
                times[f"{c} {mem}/{n}"].append(comm.allreduce(dt, op=MPI.MAX))

    alloc: dict[str, list[float]] = {mem: [] for mem in MEMORIES}
    alloc_huge: dict[str, list[int]] = {mem: [] for mem in MEMORIES}
    comm.Barrier()
    if rank == 0:
        for r in range(args.alloc_rounds):
            for mem in MEMORIES[r % 3:] + MEMORIES[:r % 3]:
                t0 = time.perf_counter()
                x = _buffers(mem, ALLOC_BYTES)
                alloc[mem].append(time.perf_counter() - t0)
                alloc_huge[mem].append(huge_kib(x.data_ptr() if isinstance(x, torch.Tensor) else x.ctypes.data,
                                                ALLOC_BYTES))
                del x
    comm.Barrier()
    huge_all = comm.gather(huge, root=0)
    if rank == 0:
        result = {"var": os.environ.get("THP_MEM_ALLOC_ENABLE"), "torch_thp_alloc": thp,
                  "thp_enabled": kernel_setting("enabled"), "thp_defrag": kernel_setting("defrag"),
                  "ranks": comm.Get_size(), "times": times, "huge_kib": huge_all, "alloc": alloc,
                  "alloc_huge_kib": alloc_huge, "torch": torch.__version__, "numpy": np.__version__,
                  "mpi": MPI.Get_library_version().split(",")[0].strip()}
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print(_job_table(result))
    if "accl" in calls:
        torch.distributed.destroy_process_group()
    return 0


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.3f} ({min(xs) * 1e3:.3f}-{max(xs) * 1e3:.3f})"


def _job_table(res: dict) -> str:
    lines = [f"THP_MEM_ALLOC_ENABLE={res['var']} (torch asks for huge pages: {res['torch_thp_alloc']}); kernel THP "
             f"enabled={res['thp_enabled']} defrag={res['thp_defrag']}; {res['ranks']} ranks",
             "all-reduce, ms per call: median (min-max) of rounds; huge pages of rank 0's buffer"]
    for key, xs in res["times"].items():
        mem_n = key.split(" ", 1)[1]
        lines.append(f"  {key:<24} {_ms(xs):<28} {res['huge_kib'][0][mem_n]} KiB huge")
    for mem, xs in res["alloc"].items():
        lines.append(f"  first touch 64 MiB {mem:<9} {_ms(xs)} ms, huge KiB {res['alloc_huge_kib'][mem]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- driver


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _wait_idle(limit: float, max_wait: float) -> float:
    """Wait (at most ``max_wait`` s) for a 3 s window in which the machine is below ``limit`` busy; the last
    window's busy fraction."""
    cores = os.cpu_count() or 1
    deadline = time.monotonic() + max_wait
    while True:
        b0 = _busy_s()
        time.sleep(3.0)
        frac = (_busy_s() - b0) / (3.0 * cores)
        if frac < limit or time.monotonic() > deadline:
            return frac
        time.sleep(7.0)


def _run_job(cmd: list[str], env: dict[str, str]) -> tuple[dict | None, float, str]:
    """One job: its result, the fraction of the machine other processes used meanwhile, its output."""
    cores = os.cpu_count() or 1
    b0, c0, t0 = _busy_s(), _children_s(), time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    foreign = ((_busy_s() - b0) - (_children_s() - c0)) / ((time.monotonic() - t0) * cores)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("{")), None)
    res = json.loads(line) if out.returncode == 0 and line else None
    return res, max(0.0, foreign), out.stdout + out.stderr


def _driver(args: argparse.Namespace) -> int:
    sys.path.insert(0, SRC)
    from torchhpc.runtime.mpirun import available_cores, local_job_env, mpiexec_argv

    results: list[dict] = []
    loads: list[float] = []
    discarded = 0
    for j in range(args.jobs):
        for var in (("0", "1") if j % 2 == 0 else ("1", "0")):
            env = local_job_env(oversubscribed=available_cores() < 2)
            env["THP_MEM_ALLOC_ENABLE"] = var
            env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
            if os.geteuid() == 0:
                env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
                env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            cmd = mpiexec_argv(2, [sys.executable, os.path.abspath(__file__), "--json", "--rounds",
                                   str(args.rounds), "--alloc-rounds", str(args.alloc_rounds), "--calls", args.calls])
            for attempt in range(args.retries + 1):
                idle = _wait_idle(args.max_foreign, args.max_wait)
                res, foreign, text = _run_job(cmd, env)
                if res is None:
                    print(text, file=sys.stderr)
                    return 1
                ok = foreign <= args.max_foreign or attempt == args.retries
                print(f"job {len(results) + 1}: THP_MEM_ALLOC_ENABLE={var}: machine {idle:.0%} busy before, other "
                      f"processes {foreign:.0%} during{'' if ok else ': discarded, again'}", file=sys.stderr)
                if ok:
                    res["foreign"] = foreign
                    results.append(res)
                    loads.append(os.getloadavg()[0])
                    break
                discarded += 1
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"results": results, "loads": loads, "discarded": discarded}, f)
    print(_driver_table(results, loads, args, discarded))
    return 0


def _cell(xs: list[float], scale: float, fmt: str) -> str:
    if not xs:
        return "-"
    lo, med, hi = _quartiles(xs)
    return f"{med * scale:{fmt}} [{lo * scale:{fmt}}-{hi * scale:{fmt}}]"


def _driver_table(results: list[dict], loads: list[float], args: argparse.Namespace, discarded: int) -> str:
    first = results[0]
    foreign = [r["foreign"] for r in results]
    calls = [c for c in args.calls.split(",") if c]
    # columns: torch's memory in the jobs with the variable 0 and 1, numpy's with and without madvise (all jobs)
    cols = [("torch", "0"), ("torch", "1"), ("numpy", None), ("numpy-4k", None)]
    names = {("torch", "0"): "torch, THP_MEM_ALLOC_ENABLE=0", ("torch", "1"): "torch, THP_MEM_ALLOC_ENABLE=1",
             ("numpy", None): "numpy (madvise)", ("numpy-4k", None): "numpy, madvise off"}

    def rows(call: str, mem: str, var: str | None, n: int, ratio: bool) -> tuple[list[float], set[int]]:
        xs: list[float] = []
        kib: set[int] = set()
        for res in results:
            if var is not None and res["var"] != var:
                continue
            mine = res["times"][f"{call} {mem}/{n}"]
            base = res["times"][f"{call} numpy/{n}"]
            xs += [a / b for a, b in zip(mine, base, strict=True)] if ratio else mine
            kib.update(h[f"{mem}/{n}"] for h in res["huge_kib"])
        return xs, kib

    out = [f"torch {first['torch']}, numpy {first['numpy']}, {first['mpi']}; kernel THP enabled="
           f"{first['thp_enabled']} defrag={first['thp_defrag']}; {first['ranks']} ranks; {args.jobs} jobs per "
           f"setting x {args.rounds} rounds; other processes used {min(foreign):.0%}-{max(foreign):.0%} of the "
           f"machine during the jobs ({discarded} jobs over {args.max_foreign:.0%} discarded and run again); load "
           f"average (1 min, includes the job's own 2 ranks) after the jobs {min(loads):.2f}-{max(loads):.2f}", "",
           "All-reduce (float32, sum, in place), ms per call: median [quartiles] over rounds; KiB of huge pages in "
           "each buffer", ""]
    head = "| call, size | " + " | ".join(names[c] for c in cols) + " |"
    out += [head, "|" + " --- |" * (len(cols) + 1)]
    for call in calls:
        for n in SIZES:
            cells = []
            for mem, var in cols:
                xs, kib = rows(call, mem, var, n, ratio=False)
                cells.append(f"{_cell(xs, 1e3, '.3f')} ({'/'.join(str(k) for k in sorted(kib))} KiB)")
            out.append(f"| {call}, {n >> 20} MiB | " + " | ".join(cells) + " |")
    out += ["", "Time relative to numpy's (madvised) buffer in the same round of the same job: median [quartiles] "
            "of the per-round ratios", "", head.replace("call, size", "call, size ")]
    out.append("|" + " --- |" * (len(cols) + 1))
    for call in calls:
        for n in SIZES:
            cells = [_cell(rows(call, mem, var, n, ratio=True)[0], 1.0, ".2f") for mem, var in cols]
            out.append(f"| {call}, {n >> 20} MiB | " + " | ".join(cells) + " |")
    out += ["", "First touch of 64 MiB (rank 0 alone: `empty` + `fill`), ms: median [quartiles]; KiB of huge pages",
            "", "| memory | THP_MEM_ALLOC_ENABLE=0 | THP_MEM_ALLOC_ENABLE=1 |", "| --- | --- | --- |"]
    for mem in MEMORIES:
        cells = []
        for var in ("0", "1"):
            xs = [x for res in results if res["var"] == var for x in res["alloc"][mem]]
            ks = sorted({k for res in results if res["var"] == var for k in res["alloc_huge_kib"][mem]})
            cells.append(f"{_cell(xs, 1e3, '.2f')} ({'/'.join(map(str, ks))} KiB)")
        out.append(f"| {mem} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run one job under mpiexec, else drive jobs with the variable off and on."""
    args = _parse(argv)
    return _job(args) if _under_mpi() else _driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
