"""Train from Python as a batch job: examples/train.py's training submitted to PBS or Slurm with torchhpc.submit,
its result handed back here.  The function below lives in ``__main__`` (as in a notebook): it travels by value.

    python examples/submit_training.py --nodes 2 --ranks-per-node 4 --walltime 00:20:00 --account UABC0001

The job runs in the site's built environment where it has torch and torchhpc, else in this one (as
``torchhpc jobscript --env auto``); every option left out comes from the site profile.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchhpc.submit import Executor, job_environment

EXAMPLES = str(Path(__file__).resolve().parent)


def fit(examples: str, argv: list[str]) -> dict:
    """Every rank runs this: examples/train.py's training (it initialises torch.distributed itself)."""
    sys.path.insert(0, examples)
    import train

    result = train.main(argv)
    return {**result, "nodes": list(job_environment().nodes)}


def train_args(steps: int) -> list[str]:
    """examples/train.py's arguments: a small model, no checkpoints (a finished call is not resumed)."""
    return ["--steps", str(steps), "--every", "0", "--width", "32", "--batch", "16", "--log-every", "10"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, kind in (("--nodes", int), ("--ranks-per-node", int), ("--cpus", int), ("--gpus", int),
                       ("--walltime", str), ("--account", str), ("--queue", str), ("--scheduler", str),
                       ("--folder", str)):
        p.add_argument(flag, type=kind, default=None)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    options = {k: v for k, v in vars(args).items() if k not in ("steps", "folder") and v is not None}
    executor = Executor(args.folder, **options)
    job = executor.submit(fit, EXAMPLES, train_args(args.steps))
    print(f"submitted {job.job_id} ({job.name}); waiting ...", flush=True)
    result = job.result()
    print(f"loss {result['loss']!r} on {' '.join(result['nodes'])}: {result['samples_per_s']:.0f} samples/s; "
          f"rank 0 printed:\n{job.stdout(0)}", flush=True)


if __name__ == "__main__":
    main()
