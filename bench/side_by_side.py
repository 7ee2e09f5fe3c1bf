"""accl now against accl at an earlier commit, built side by side and timed in interleaved rounds.

The earlier tree is checked out into a private temporary folder (``git worktree``) and its backend built there
with its own ``corebuild``.  Each round runs this file's timer once per tree under ``mpiexec -n 2`` (the order
alternating round by round): an ``accl`` process group through torch's own ``env://`` rendezvous (both trees
register the backend at ``import torchhpc.accl``), then for each collective and size (8 B - 4 MiB, every power of
two) 5 timed repeats of a calibrated number of calls after a warm-up, the median repeat's time per call.  Prints,
for every collective and size, each tree's median over the rounds, their ratio and each one's range across rounds;
``--json`` keeps every round.

    python bench/side_by_side.py --old 879323f --rounds 3 --json docs/data/accl-side-by-side.json

Run it on an idle machine: both trees time the same calls on the same cores in alternating rounds, so what a stray
process costs one round shows as a spread, not as a difference between the trees.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from torchhpc.runtime.mpirun import mpiexec_argv  # noqa: E402  (this tree's launcher for both trees' ranks)

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
SIZES = [8 << k for k in range(20)]  # 8 B .. 4 MiB


def _timer() -> None:
    """The rank program: every collective at every size on float32 tensors; rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist

    import torchhpc.accl  # noqa: F401  (registers the backend)

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=os.environ["OMPI_COMM_WORLD_RANK"],
                      WORLD_SIZE=os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("accl", init_method="env://")
    p = dist.get_world_size()
    calls = {
        "all_reduce": lambda x, out: dist.all_reduce(x),
        "broadcast": lambda x, out: dist.broadcast(x, 0),
        "all_gather": lambda x, out: dist.all_gather_into_tensor(out, x),
        "reduce_scatter": lambda x, out: dist.reduce_scatter_tensor(out[: x.numel() // p], x),
        "all_to_all": lambda x, out: dist.all_to_all_single(out[: x.numel()], x),
    }
    results = []
    for name in os.environ.get("SIDE_COLLECTIVES", ",".join(COLLECTIVES)).split(","):
        for size in SIZES:
            x = torch.ones(max(size // 4, p))  # the bytes every rank passes in
            out = torch.empty(x.numel() * p)
            one = calls[name]
            for _ in range(20):
                one(x, out)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(10):
                one(x, out)
            n = max(10, min(2000, int(0.04 / max((time.perf_counter() - start) / 10, 1e-7))))
            n = torch.tensor([n])
            dist.broadcast(n, 0)  # every rank the same count
            reps = []
            for _ in range(5):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(int(n)):
                    one(x, out)
                reps.append((time.perf_counter() - start) / int(n))
            results.append({"collective": name, "size": size, "median_s": statistics.median(reps)})
    if dist.get_rank() == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def _round(src: Path, collectives: str) -> list[dict]:
    """One run of the timer at 2 ranks with the package at ``src``, of ``collectives`` (comma-separated)."""
    env = {**os.environ, "SIDE_COLLECTIVES": collectives, "PYTHONPATH": str(src), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1", "MASTER_PORT": "29533"}
    cmd = mpiexec_argv(2, [sys.executable, str(Path(__file__).resolve()), "--timer"])
    done = subprocess.run(cmd, cwd=src.parent, env=env, capture_output=True, text=True, timeout=1800, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the timer with {src} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULTS "):])


def summary(rounds: list[dict]) -> list[dict]:
    """Per (collective, size): each tree's median time per call over the rounds, its range, and new/old."""
    times: dict[tuple[str, int, str], list[float]] = {}
    for r in rounds:
        for p in r["points"]:
            times.setdefault((p["collective"], p["size"], r["tree"]), []).append(p["median_s"])
    rows = []
    for coll in COLLECTIVES:
        for size in SIZES:
            old, new = times.get((coll, size, "old")), times.get((coll, size, "new"))
            if old and new:
                rows.append({"collective": coll, "size": size, "old_us": statistics.median(old) * 1e6,
                             "new_us": statistics.median(new) * 1e6,
                             "old_range_us": [min(old) * 1e6, max(old) * 1e6],
                             "new_range_us": [min(new) * 1e6, max(new) * 1e6],
                             "ratio": statistics.median(new) / statistics.median(old)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="the earlier commit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--collectives", default=",".join(COLLECTIVES), help="a comma-separated subset of the default")
    ap.add_argument("--json", type=Path, help="write every round and the summary here")
    ap.add_argument("--timer", action="store_true", help=argparse.SUPPRESS)  # a rank of one round
    args = ap.parse_args(argv)
    if not set(args.collectives.split(",")) <= set(COLLECTIVES):
        ap.error(f"--collectives must be a comma-separated subset of {','.join(COLLECTIVES)}")
    if args.timer:
        _timer()
        return 0
    if not args.old:
        ap.error("--old COMMIT is required")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="torchhpc-side-") as tmp:
        tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), args.old], cwd=ROOT, check=True)
        try:
            subprocess.run([sys.executable, "-m", "torchhpc.accl.corebuild"], cwd=tree, check=True,
                           env={**os.environ, "PYTHONPATH": str(tree / "src")})
            trees = {"old": tree / "src", "new": ROOT / "src"}
            for i in range(args.rounds):
                for name in (("old", "new") if i % 2 == 0 else ("new", "old")):
                    rounds.append({"tree": name, "round": i, "points": _round(trees[name], args.collectives)})
                    print(f"round {i + 1}: {name} done", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    rows = summary(rounds)
    print(f"\n{'collective':15s} {'bytes':>8s} {'old us':>8s} {'new us':>8s} {'new/old':>7s}  old range   new range")
    for r in rows:
        print(f"{r['collective']:15s} {r['size']:8d} {r['old_us']:8.1f} {r['new_us']:8.1f} {r['ratio']:7.2f}  "
              f"{r['old_range_us'][0]:.1f}-{r['old_range_us'][1]:.1f}  {r['new_range_us'][0]:.1f}-"
              f"{r['new_range_us'][1]:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"old": args.old, "rounds": rounds, "summary": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
