"""How long a job that loses a node takes to train again: restart in place on a spare node against Slurm's requeue.

On a running 4-node Slurm virtual cluster (`make cluster-up NODES=4`; `make recovery-bench` brings it up), each
trial runs examples/resumable_training.py on 2 nodes and tears one of them down (link cut, every process killed)
after the second checkpoint: ``in-place`` (`torchhpc jobscript --nodes 2 --spare-nodes 1`: the supervisor
restarts the step on the spare) and ``requeue`` (`sbatch --requeue`: Slurm ends the job NODE_FAIL and starts it
again), interleaved.  A trial's time runs from the fault to the line the resumed run prints before its first
step; its final parameters must equal an uninterrupted run's, bit for bit.  Prints a table and writes JSON.

    python tests/vcluster/recovery.py --trials 3 --json build/recovery.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _vcluster import Cluster, restart_trial, state_dir, uninterrupted_digest  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3, help="trials of each way (interleaved)")
    p.add_argument("--json", type=Path, default=None, help="write every trial's figures here")
    args = p.parse_args(argv)
    cluster = Cluster(state_dir(), "slurm")
    reference = uninterrupted_digest(cluster)
    trials = []
    for i in range(args.trials):
        for how in ("in-place", "requeue"):
            t = restart_trial(cluster, how, f"recovery-{how}-{i}")
            t.update(bitwise=t["digest"] == reference, log=None)
            trials.append(t)
            print(f"{how:9s} trial {i + 1}: {t['recovery_s']:6.1f} s to resume (step {t['resumed_at']}), "
                  f"{t['state']}, bitwise {'equal' if t['bitwise'] else 'DIFFERENT'}", flush=True)
            time.sleep(5)  # the revived node back in service
    print(f"\n{'restart':9s} {'trials':>6s} {'median s':>9s} {'min s':>7s} {'max s':>7s} {'bitwise':>8s} "
          f"{'completed':>9s}")
    for how in ("in-place", "requeue"):
        mine = [t for t in trials if t["how"] == how]
        secs = [t["recovery_s"] for t in mine]
        print(f"{how:9s} {len(mine):6d} {statistics.median(secs):9.1f} {min(secs):7.1f} {max(secs):7.1f} "
              f"{sum(t['bitwise'] for t in mine):5d}/{len(mine)} {sum(t['state'] == 'COMPLETED' for t in mine):6d}/"
              f"{len(mine)}")
    if args.json:
        args.json.write_text(json.dumps({"trials": trials, "reference": reference}, indent=1))
    return 0 if all(t["bitwise"] and t["state"] == "COMPLETED" for t in trials) else 1


if __name__ == "__main__":
    raise SystemExit(main())
