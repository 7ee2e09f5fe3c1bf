"""A Python user of torchhpc.submit on the virtual cluster's login node: functions defined here, in ``__main__``
(not importable from the jobs), submitted together, then waited for; one JSON line with what came back.
(Training through torchhpc.submit is examples/submit_training.py, run beside this.)

``python submit_driver.py FOLDER SCHEDULER ARRAY_SIZE [timeout]`` (run by tests/test_vcluster.py and
test_vcluster_pbs.py; ``timeout`` adds the walltime-kill call):

- ``error``: rank 1 raises ValueError; what ``exception()`` and ``result()`` give back;
- ``cancel``: a call that sleeps, cancelled once running; its state and error;
- ``timeout``: a call that sleeps past its one-minute walltime; its state and error;
- ``requeue``: a callable with a checkpoint hook that needs longer than its one-minute walltime: it checkpoints
  (torchhpc.checkpoint) near the limit, is submitted again and resumes; its result and job ids;
- ``array``: ARRAY_SIZE small calls through ``map_array``; their results.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from torchhpc.submit import Executor, job_environment, maybe_requeue

REQUEUE_STEPS = 36


def boom() -> int:
    env = job_environment()
    if env.rank == 1:
        raise ValueError(f"rank 1 gave up on {env.nodes[-1]}")
    return env.rank


def sleeper() -> None:
    time.sleep(600)


class Countdown:
    """Adds rank + step over the ranks for REQUEUE_STEPS one-second steps, longer than the job's walltime allows;
    its checkpoint hook saves the running sum with torchhpc.checkpoint, and a resumed call continues from it."""

    def __init__(self, ckpt: str) -> None:
        self.ckpt = ckpt
        self.state: dict = {}

    def __call__(self) -> dict:
        import torch
        import torch.distributed as dist

        from torchhpc import checkpoint

        self.state = {"step": torch.zeros((), dtype=torch.int64), "total": torch.zeros((), dtype=torch.int64)}
        found = checkpoint.latest(self.ckpt)
        start = checkpoint.load(self.state, found) if found else 0
        for step in range(start, REQUEUE_STEPS):
            value = torch.tensor(dist.get_rank() + step)
            dist.all_reduce(value)
            self.state["total"] += value
            self.state["step"].fill_(step + 1)
            time.sleep(1)
            maybe_requeue()
        env = job_environment()
        return {"total": int(self.state["total"]), "started_at": start, "attempt": env.attempt}

    def checkpoint(self) -> None:
        from torchhpc import checkpoint

        checkpoint.save(self.state, self.ckpt, int(self.state["step"]))


def square(x: int) -> int:
    return x * x


def main(folder: str, scheduler: str, array: int, walltime_kill: bool) -> dict:
    base = {"scheduler": scheduler, "cpus": 1, "folder": folder}
    two = Executor(nodes=2, ranks_per_node=1, walltime="00:05:00", **base)
    jobs = {"error": two.submit(boom)}
    ckpt = Path(folder).parent / "countdown-ckpt"
    jobs["requeue"] = Executor(nodes=2, ranks_per_node=1, walltime="00:01:00", init=True, warn_s=30,
                               **base).submit(Countdown(str(ckpt)))
    one = Executor(nodes=1, ranks_per_node=1, walltime="00:05:00", **base)
    cancel = one.submit(sleeper)
    timed = Executor(nodes=1, ranks_per_node=1, walltime="00:01:00", **base).submit(sleeper) if walltime_kill \
        else None
    deadline = time.monotonic() + 240
    while cancel.state != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
    cancel.cancel()
    squares = one.map_array(square, range(array))
    out: dict = {"folder_mode": oct(os.stat(folder).st_mode & 0o777)}
    error = jobs["error"].exception(timeout=600)
    out["error"] = {"text": str(error), "cause": repr(error.__cause__) if error else None,
                    "rank0_err": jobs["error"].stderr(0), "rank1_err": jobs["error"].stderr(1)}
    cancelled = cancel.exception(timeout=600)
    out["cancel"] = {"state": cancel.wait(), "text": str(cancelled)}
    out["array"] = [job.result(timeout=600) for job in squares]
    if timed is not None:
        out["timeout"] = {"state": timed.wait(timeout=600), "text": str(timed.exception())}
    requeued = jobs["requeue"]
    try:
        out["requeue"] = {"result": requeued.result(timeout=600), "ids": requeued.job_ids}
    except Exception as exc:  # noqa: BLE001
        out["requeue"] = {"error": str(exc), "ids": requeued.job_ids, "out0": requeued.stdout(0),
                          "err0": requeued.stderr(0)}
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:] == ["timeout"])),
          flush=True)
