"""Inside a job :mod:`torchhpc.submit` wrote: every rank runs the submitted call and writes its outcome.

``python -m torchhpc.submit FOLDER`` is what each rank of the job runs (the launcher starts one per rank).
A rank sends its output to ``rank-<r>.out``/``.err`` in the folder, initialises ``torch.distributed`` when asked,
runs ``fn(*args, **kwargs)`` and writes its return value or its error with its traceback and host.

Time limits: :func:`maybe_requeue`, called by the function once per step on every rank, says whether the job's
time is nearly up (``warn_s`` before the scheduler's limit) or the scheduler warned with ``SIGUSR1`` (Slurm's
``--signal``, ``scancel --signal=USR1``, PBS's ``qsig -s USR1``).  If so on any rank, it calls the callable's
``checkpoint(*args, **kwargs)`` hook on every rank, submits the job again and ends this run; the new job calls the
callable again, which resumes from what the hook saved.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import folder as files
from . import scheduler

__all__ = ["JobEnvironment", "job_environment", "maybe_requeue", "main"]

_PEER_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class JobEnvironment:
    """Where this rank runs: its place in the job, the job's nodes (in rank order), id, scheduler and attempt
    (1 for the first run, 2 after the first requeue, ...)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    nodes: tuple[str, ...]
    job_id: str
    scheduler: str
    attempt: int
    folder: Path


@dataclass
class _Run:
    env: JobEnvironment
    fn: Any
    args: tuple
    kwargs: dict
    spec: dict
    comm: Any  # MPI.COMM_WORLD with several ranks, else None
    deadline: float | None  # time.monotonic() at which to checkpoint, None: no limit known
    warned: bool = False


_RUN: _Run | None = None


def _current() -> _Run:
    if _RUN is None:
        raise files.JobError("not inside a job submitted with torchhpc.submit (python -m torchhpc.submit FOLDER)")
    return _RUN


def job_environment() -> JobEnvironment:
    """This rank's :class:`JobEnvironment`; :class:`~torchhpc.submit.JobError` outside a submitted job."""
    return _current().env


class _Requeued(BaseException):
    """Ends the run after its checkpoint and resubmission (not an ``Exception``: the function must not catch it)."""


def maybe_requeue() -> None:
    """Call once per step, at the same point on every rank.  Near the time limit (or after ``SIGUSR1``) on any
    rank: the callable's ``checkpoint(*args, **kwargs)`` runs on every rank, the job is submitted again and this
    run ends; otherwise it returns at once (one small collective).  A callable without ``checkpoint`` runs on."""
    from ..runtime.waiting import agree, allgather_object

    run = _current()
    due = run.warned or (run.deadline is not None and time.monotonic() >= run.deadline)
    if run.comm is not None:
        due = any(allgather_object(run.comm, due, _PEER_TIMEOUT_S, "torchhpc.submit.maybe_requeue()"))
    hook = getattr(run.fn, "checkpoint", None)
    if not due or not callable(hook):
        return
    hook(*run.args, **run.kwargs)
    error = None
    if run.env.rank == 0:
        try:
            _submit_again(run)
        except files.JobError as exc:
            error = exc
    if run.comm is not None:
        agree(run.comm, error, _PEER_TIMEOUT_S, "torchhpc.submit.maybe_requeue()")
    if error is not None:
        raise error
    raise _Requeued


def _submit_again(run: _Run) -> None:
    """Submit the same job again through the job layer (its record appended to the folder's ``jobs``)."""
    if (run.env.folder / files.CANCELLED).exists():
        raise files.JobError(f"job {run.env.job_id} was cancelled: it is not submitted again")
    done = subprocess.run(run.spec["submit"], env=run.spec["env"], cwd=run.spec["workdir"], capture_output=True,
                          text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise files.JobError(f"job {run.env.job_id} could not be submitted again: {done.stderr.strip()[-2000:]}")
    print(f"torchhpc.submit: checkpointed and submitted again as job {files.records(run.env.folder)[-1]['JOB_ID']}",
          flush=True)


def _redirect(folder: Path, rank: int) -> None:
    """This rank's stdout and stderr (the file descriptors: C++ and child processes too) to its files."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, stream in ((1, "out"), (2, "err")):
        out = os.open(files.output_path(folder, rank, stream), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(out, fd)
        os.close(out)


def _start(folder: Path) -> _Run:
    """Read the call, learn the job's nodes and time left (asked once, by rank 0), and say so."""
    from ..runtime.world import world_info

    info = world_info()
    _redirect(folder, info.rank)
    fn, args, kwargs, spec = files.read_call(folder)
    comm = None
    if info.world_size > 1:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    recs = files.records(folder)
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID") or (recs[-1]["JOB_ID"] if recs else "?")
    sched = recs[-1]["JOB_SCHEDULER"] if recs else ("slurm" if "SLURM_JOB_ID" in os.environ else "pbs")
    left = scheduler.time_left(sched, job_id) if info.rank == 0 else None
    mine = (socket.gethostname(), left)
    if comm is not None:
        from ..runtime.waiting import allgather_object

        everyone = allgather_object(comm, mine, _PEER_TIMEOUT_S, "torchhpc.submit's start")
    else:
        everyone = [mine]
    left = everyone[0][1]
    nodes = tuple(dict.fromkeys(host for host, _ in everyone))
    env = JobEnvironment(info.rank, info.local_rank, info.world_size, info.local_size, nodes, job_id, sched,
                         max(len(recs), 1), folder)
    if info.rank == 0:
        files.write_json(folder, "world.json", {"world_size": info.world_size, "nodes": list(nodes),
                                                "job_id": job_id, "attempt": env.attempt})
    deadline = None if left is None else time.monotonic() + left - float(spec["warn_s"])
    print(f"torchhpc.submit: rank {info.rank} of {info.world_size} on {mine[0]}, job {job_id} (attempt "
          f"{env.attempt}), {'no time limit known' if left is None else f'{left:.0f} s left'}", flush=True)
    return _Run(env, fn, args, kwargs, spec, comm, deadline)


def _failure(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "type": type(exc).__name__, "message": str(exc), "host": socket.gethostname(),
            "traceback": "".join(traceback.format_exception(exc)), "exception": exc}


def _init(backend: str | bool) -> None:
    """``torch.distributed`` for the call: ``True`` picks nccl with GPUs, else accl (MPI)."""
    import torch

    from ..launcher import init_distributed

    if backend is True:
        backend = "nccl" if torch.cuda.is_available() else "accl"
    init_distributed(str(backend))


def main(argv: list[str]) -> int:
    """Run the submitted call on this rank; the exit status is 0 when it returned (or was requeued).  A rank whose
    call raised writes its error, then ends the job (``MPI_Abort``): no other rank waits for it."""
    global _RUN
    if len(argv) != 1:
        print("usage: python -m torchhpc.submit FOLDER (written by torchhpc.submit)", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    _RUN = run = _start(folder)

    def warned(signum: int, frame: Any) -> None:  # noqa: ARG001
        run.warned = True

    signal.signal(signal.SIGUSR1, warned)
    initialised = False
    try:
        if run.spec["init"]:
            _init(run.spec["init"])
            initialised = True
        outcome: dict[str, Any] = {"ok": True, "value": run.fn(*run.args, **run.kwargs)}
    except _Requeued:
        return 0
    except BaseException as exc:  # noqa: BLE001  (a SystemExit or KeyboardInterrupt of the call is its outcome too)
        outcome = _failure(exc)
        traceback.print_exception(exc)
    finally:
        if initialised:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    files.write_outcome(folder, run.env.rank, outcome)
    if not outcome["ok"] and run.comm is not None:
        # an error on one rank ends every rank: the others may wait for it in a collective (or at MPI_Finalize)
        sys.stdout.flush()
        sys.stderr.flush()
        run.comm.Abort(1)
    return 0 if outcome["ok"] else 1
