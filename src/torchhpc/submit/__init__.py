"""Run a Python function on every rank of a PBS or Slurm job, from Python, and get back its result.

::

    from torchhpc.submit import Executor

    ex = Executor("~/runs", nodes=2, ranks_per_node=4, walltime="01:00:00", account="UABC0001", init=True)
    job = ex.submit(train, epochs=10)       # pickled (cloudpickle: notebooks and __main__ too), submitted
    job.job_id, job.state                   # the scheduler's id and state (Slurm's words, for PBS too)
    loss = job.result()                     # waits; rank 0's return value (job.results(): every rank's)

The job script is the one ``torchhpc jobscript`` writes (same site profiles, options, environment choice and
launcher line); each rank runs :mod:`torchhpc.submit.worker`, with ``torch.distributed`` initialised when asked
(``init=True``: nccl with GPUs, accl on CPUs; or a backend's name).  A rank's exception comes back as
:class:`JobError` naming the rank and host, with its traceback, raised from the original exception where it
unpickles.  A callable object with a ``checkpoint(*args, **kwargs)`` method that calls :func:`maybe_requeue` once
per step is checkpointed near its time limit, submitted again, and resumed; the :class:`Job` follows it.

Everything a job reads or writes lives in a folder of its own under the executor's folder (0700, the user's
alone, on a file system the nodes share): nothing is unpickled from a place another user could write.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .. import jobscript
from ..runtime import private
from . import folder as files
from . import scheduler
from .folder import JobError
from .worker import JobEnvironment, job_environment, maybe_requeue

__all__ = ["Executor", "Job", "JobError", "JobEnvironment", "job_environment", "maybe_requeue"]


class Job:
    """One submitted call, followed through its scheduler and its requeues to its outcome."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder = folder
        self.name = name

    def __repr__(self) -> str:
        return f"Job({self.name!r}, job_id={self.job_id!r})"

    @property
    def job_ids(self) -> list[str]:
        """Every job id this call ran under, oldest first (one more per requeue)."""
        return [r["JOB_ID"] for r in files.records(self.folder)]

    @property
    def job_id(self) -> str:
        """The newest job id: the job that runs (or ran last)."""
        return self.job_ids[-1]

    @property
    def scheduler(self) -> str:
        return files.records(self.folder)[-1]["JOB_SCHEDULER"]

    @property
    def state(self) -> str:
        """The newest job's state in Slurm's words (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``,
        ``CANCELLED``, ``TIMEOUT``, ...; ``GONE`` once the scheduler has forgotten it)."""
        return scheduler.state(self.scheduler, self.job_id)

    def _final_state(self) -> str | None:
        """The newest job's final state once the call runs no more (it ended and was not submitted again: a job
        that requeues itself records its successor before it ends), else None.  One scheduler query.  A job
        :meth:`cancel` ended before every rank returned is ``CANCELLED`` whatever its scheduler recorded: OpenPBS
        records a job deleted as it starts as an ordinary exit (seen: ``Exit_status = 0``, not substate 91)."""
        records = files.records(self.folder)
        state = scheduler.state(records[-1]["JOB_SCHEDULER"], records[-1]["JOB_ID"])
        if state not in scheduler.FINAL or len(files.records(self.folder)) != len(records):
            return None
        if state != "CANCELLED" and (self.folder / files.CANCELLED).exists() \
                and not files.every_rank_returned(self.folder):
            return "CANCELLED"
        return state

    def done(self) -> bool:
        """Whether the call runs no more: its newest job has ended and was not submitted again."""
        return self._final_state() is not None

    def wait(self, timeout: float | None = None) -> str:
        """Wait until :meth:`done` (polling the scheduler every 0.5 s, growing to 5 s); returns the final state.
        :class:`JobError` after ``timeout`` seconds, the job left running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.5
        while (state := self._final_state()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise JobError(f"job {self.job_id} ({self.name}) still {self.state} after {timeout:g} s")
            time.sleep(pause)
            pause = min(2 * pause, 5.0)
        return state

    def results(self, timeout: float | None = None) -> list[Any]:
        """Every rank's return value, in rank order, once the job is done; :class:`JobError` for a rank's
        exception (the lowest failing rank's, with its traceback and host), or for a job its scheduler ended
        (time limit, node failure, cancelled) before every rank returned."""
        state = self.wait(timeout)
        label = f"job {self.job_id} ({self.name})"
        world = files.read_json(self.folder, "world.json")
        if world is None:
            raise JobError(f"{label} ended {state} before its ranks started: {_why(state)}; its log: {self._log()}")
        outcomes = [files.read_outcome(self.folder, r, label) for r in range(world["world_size"])]
        for rank, outcome in enumerate(outcomes):
            if outcome is not None and not outcome["ok"]:
                raise JobError(f"{label}: rank {rank} on {outcome['host']} raised {outcome['type']}: "
                               f"{outcome['message']}\n\nrank {rank}'s traceback:\n{outcome['traceback']}"
                               ) from outcome["exception"]
        missing = [r for r, outcome in enumerate(outcomes) if outcome is None]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise JobError(f"{label} ended {state} before rank {missing[0]} returned{more}: {_why(state)}; rank "
                           f"{missing[0]}'s output: {files.output_path(self.folder, missing[0], 'err')}")
        return [outcome["value"] for outcome in outcomes if outcome is not None]

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value once the job is done (see :meth:`results` for the errors)."""
        return self.results(timeout)[0]

    def exception(self, timeout: float | None = None) -> JobError | None:
        """The :class:`JobError` :meth:`result` would raise, or None when every rank returned."""
        try:
            self.results(timeout)
        except JobError as exc:
            return exc
        return None

    def cancel(self) -> None:
        """End the job (``scancel``/``qdel``) and keep it from being submitted again."""
        files.write_json(self.folder, files.CANCELLED, True)
        complaint = scheduler.cancel(self.scheduler, self.job_id)
        if complaint and self.state not in scheduler.FINAL:
            raise JobError(f"job {self.job_id} ({self.name}) could not be cancelled: {complaint}")

    def stdout(self, rank: int = 0) -> str | None:
        """What rank ``rank`` printed (every attempt's), or None before it started."""
        return self._output(rank, "out")

    def stderr(self, rank: int = 0) -> str | None:
        """What rank ``rank`` wrote to stderr, tracebacks included (every attempt's), or None before it started."""
        return self._output(rank, "err")

    def _output(self, rank: int, stream: str) -> str | None:
        path = files.output_path(self.folder, rank, stream)
        return path.read_text(errors="replace") if path.exists() else None

    def _log(self) -> str:
        return files.records(self.folder)[-1].get("JOB_LOG", "?")


def _why(state: str) -> str:
    return {"TIMEOUT": "the scheduler ended it at its time limit", "CANCELLED": "it was cancelled (scancel/qdel)",
            "NODE_FAIL": "a node of the job failed", "OUT_OF_MEMORY": "a rank ran out of memory",
            "PREEMPTED": "the scheduler preempted it"}.get(state, "it failed or was killed (see its log)")


class Executor:
    """Submits calls as PBS or Slurm jobs with the options of ``torchhpc jobscript`` (None: the site profile's).

    ``folder``: where each call's folder goes (default ``~/.cache/torchhpc/submit``), on a file system the
    compute nodes see; ``init``: initialise ``torch.distributed`` before the call (``True``: nccl with GPUs, accl
    on CPUs; or a backend name); ``warn_s``: how long before the time limit :func:`maybe_requeue` checkpoints;
    ``env``: the job's Python, ``"site"``, ``"current"`` or ``"auto"`` as for ``torchhpc jobscript --env``;
    ``spare_nodes``: nodes held beyond ``nodes``, on which the step restarts in place of a failed one."""

    def __init__(self, folder: str | os.PathLike[str] | None = None, *, nodes: int | None = None,
                 spare_nodes: int | None = None, ranks_per_node: int | None = None, gpus: int | None = None,
                 cpus: int | None = None, walltime: str | None = None, account: str | None = None,
                 queue: str | None = None,
                 scheduler: str | None = None, site: str | None = None, launcher: str | None = None,
                 env: str = "auto", checkout: str | None = None, init: bool | str = False,
                 warn_s: float = 120.0) -> None:
        if scheduler not in (None, "pbs", "slurm"):
            raise ValueError(f"scheduler must be 'pbs' or 'slurm', got {scheduler!r}")
        if env not in ("auto", "site", "current"):
            raise ValueError(f"env must be 'auto', 'site' or 'current', got {env!r}")
        if warn_s < 0:
            raise ValueError(f"warn_s must be at least 0, got {warn_s}")
        self.folder = Path(folder).expanduser() if folder is not None else None
        self.options = argparse.Namespace(nodes=nodes, spare_nodes=spare_nodes, ranks_per_node=ranks_per_node,
                                          gpus=gpus, cpus=cpus, walltime=walltime, account=account, queue=queue,
                                          scheduler=scheduler,
                                          name=None, detach=True, submit=False)
        self.site, self.launcher, self.env, self.checkout = site, launcher, env, checkout
        self.init, self.warn_s = init, warn_s
        self._setup: tuple[Path, dict[str, str]] | None = None

    def _prepare(self) -> tuple[Path, dict[str, str]]:
        """The checkout and the job environment's variables, found and checked once per executor."""
        if self._setup is None:
            extra = {"TORCHHPC_PROG": "torchhpc.submit"}
            if self.site:
                extra["SITE"] = self.site
            if self.launcher:
                extra["LAUNCHER"] = self.launcher
            try:
                checkout = jobscript.find_checkout(self.checkout)
                extra.update(jobscript.choose_env(self.env, checkout, {**os.environ, **extra}))
            except SystemExit as exc:  # the command line's wording, raised as this API's error
                raise JobError(str(exc).replace("torchhpc jobscript:", "torchhpc.submit:", 1)) from None
            # the whole environment of the submission, kept in the call's private folder: a job that submits
            # itself again does so as the first submission did (sbatch passes it on; qsub starts afresh)
            self._setup = checkout, {**os.environ, **extra}
        return self._setup

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Job:
        """Submit ``fn(*args, **kwargs)`` to run on every rank of one job; returns its :class:`Job` at once."""
        if not callable(fn):
            raise TypeError(f"submit() needs a callable, got {type(fn).__name__}")
        checkout, env = self._prepare()
        stem = re.sub(r"[^A-Za-z0-9]+", "-", getattr(fn, "__name__", type(fn).__name__)).strip("-")[:24] or "call"
        name = f"{stem if stem[0].isalpha() else 'call-' + stem}-{time.strftime('%Y%m%d-%H%M%S')}-" \
               f"{secrets.token_hex(3)}"
        root = self.folder if self.folder is not None else private.cache_dir("submit")
        where = files.create(root, name)
        options = argparse.Namespace(**{**vars(self.options), "name": name})
        argv = jobscript.submit_args(options, checkout, ["python", "-m", "torchhpc.submit", str(where)],
                                     record=where / "jobs")
        spec = {"name": name, "init": self.init, "warn_s": self.warn_s, "submit": argv, "env": env,
                "workdir": str(Path.cwd())}
        files.write_call(where, fn, args, kwargs, spec)
        done = _run_submit(argv, env)
        if done is not None or not files.records(where):
            raise JobError(f"torchhpc.submit: {name} was not submitted: {done or 'no job record was written'}")
        return Job(where, name)

    def map_array(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> list[Job]:
        """``fn`` over the zipped ``iterables``: one job per call, all submitted before any is waited for."""
        return [self.submit(fn, *call) for call in zip(*iterables, strict=True)]


def _run_submit(argv: list[str], env: dict[str, str]) -> str | None:
    """Run the job layer's submission; None once submitted, else what it said."""
    import subprocess

    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    return None if done.returncode == 0 else (done.stderr.strip() or done.stdout.strip())[-3000:]
