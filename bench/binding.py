"""Bound against unbound ranks: the training template's throughput with each rank on its own cores or floating.

Runs examples/train.py (DDP on accl, 2 ranks on this node by default) under Open MPI's ``mpiexec`` three ways, in
interleaved rounds (each round runs all three, starting one further along the list):

* ``bound``: ``--map-by ppr:N:node:PE=C --bind-to core``, the launcher's binding flags (what ``torchhpc jobscript``
  writes);
* ``self-bound``: ``--bind-to none`` and ``TORCHHPC_BIND=1``, each rank binding itself to its share at import;
* ``unbound``: ``--bind-to none`` and ``TORCHHPC_BIND=0``: the ranks float over every core (threads split).

A round's figure is the median samples/s that rank 0 reports; the table gives each way's median round, its spread
((max - min) / median) and its ratio to ``bound``.  Check the machine is idle first.

    python bench/binding.py --rounds 5 --ranks 2 --steps 150
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from torchhpc.runtime.mpirun import find_mpiexec  # noqa: E402

WAYS = ("bound", "self-bound", "unbound")


def run(way: str, ranks: int, steps: int) -> float:
    """One run of the template: rank 0's median samples/s."""
    cores = len(os.sched_getaffinity(0)) // ranks
    if way == "bound" and cores < 1:
        raise SystemExit(f"bench/binding.py: {ranks} ranks on {len(os.sched_getaffinity(0))} cores: nothing to bind")
    placement = ["--map-by", f"ppr:{ranks}:node:PE={cores}", "--bind-to", "core"] if way == "bound" else \
        ["--bind-to", "none"]
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "TORCHHPC_BIND": "0" if way == "unbound" else "1"}
    env.pop("OMP_NUM_THREADS", None)  # the thread budget follows the binding
    argv = [find_mpiexec(), "-n", str(ranks), *placement, "-x", "TORCHHPC_BIND", sys.executable,
            str(ROOT / "examples" / "train.py"), "--steps", str(steps), "--every", "0", "--log-every", str(steps),
            "--width", "256", "--batch", "64", "--backend", "accl"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, check=False)
    found = re.search(r"median (\d+) samples/s", done.stdout)
    if done.returncode != 0 or not found:
        raise SystemExit(f"bench/binding.py: {way} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    got: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(args.rounds):
        for way in WAYS[r % 3:] + WAYS[:r % 3]:
            got[way].append(run(way, args.ranks, args.steps))
        print(f"round {r + 1}: " + ", ".join(f"{w} {got[w][-1]:.0f}" for w in WAYS), flush=True)
    base = statistics.median(got["bound"])
    print(f"\n{args.ranks} ranks on {len(os.sched_getaffinity(0))} cores, {args.steps} steps, {args.rounds} rounds")
    print(f"{'ranks':11s} {'samples/s':>10s} {'spread':>7s} {'vs bound':>9s}")
    for way in WAYS:
        med = statistics.median(got[way])
        print(f"{way:11s} {med:10.0f} {(max(got[way]) - min(got[way])) / med:7.1%} {med / base:8.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"ranks": args.ranks, "cores": len(os.sched_getaffinity(0)),
                                         "steps": args.steps, "samples_per_s": got}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
