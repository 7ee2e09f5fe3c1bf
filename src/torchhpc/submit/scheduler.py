"""The scheduler's view of one job, for :mod:`torchhpc.submit`: its state, the time it has left, cancelling it.

Slurm through ``scontrol``/``squeue``/``scancel``, PBS through ``qstat -x``/``qdel``; states are named with Slurm's
words for both (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``, ``CANCELLED``, ``TIMEOUT``, ...), plus ``GONE``
for a job the scheduler no longer remembers and ``UNKNOWN`` when it did not answer this time.
"""

from __future__ import annotations

import re
import subprocess
import time

__all__ = ["FINAL", "state", "time_left", "cancel"]

# states after which the job runs no more (a requeued job is a new job: see torchhpc.submit.Job)
FINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                   "DEADLINE", "PREEMPTED", "GONE"})
_PBS_WAITING = {"Q": "PENDING", "W": "PENDING", "H": "PENDING", "T": "PENDING", "S": "SUSPENDED",
                "R": "RUNNING", "B": "RUNNING", "E": "COMPLETING", "X": "COMPLETED"}
_PBS_KILLED_WALLTIME, _PBS_DELETED = -29, 91  # Exit_status JOB_EXEC_KILL_WALLTIME; substate TERMINATED (qdel)


def _ask(argv: list[str]) -> subprocess.CompletedProcess[str] | None:
    """Run one scheduler client command; None when it cannot be run or does not answer in time."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _pbs_record(job_id: str) -> dict[str, str] | None:
    """``qstat -x -f JOB``'s fields (continuation lines joined); {} for a job PBS forgot, None for no answer."""
    done = _ask(["qstat", "-x", "-f", job_id])
    if done is None:
        return None
    if done.returncode != 0:
        return {} if "Unknown Job Id" in done.stdout + done.stderr else None
    fields: dict[str, str] = {}
    key = ""
    for line in done.stdout.splitlines():
        if " = " in line and line.startswith("    "):
            key, _, value = line.strip().partition(" = ")
            fields[key] = value
        elif key and line.startswith("\t"):
            fields[key] += line.strip()
    return fields


def state(scheduler: str, job_id: str) -> str:
    """The job's state in Slurm's words (PBS's letters, exit status and substate translated)."""
    if scheduler == "slurm":
        done = _ask(["scontrol", "show", "job", "-o", job_id])
        if done is None:
            return "UNKNOWN"
        found = re.search(r"JobState=([A-Z_]+)", done.stdout)
        if found:
            return found.group(1)
        return "GONE" if "Invalid job id" in done.stderr else "UNKNOWN"  # forgotten after MinJobAge
    fields = _pbs_record(job_id)
    if fields is None:
        return "UNKNOWN"
    if not fields:
        return "GONE"
    letter = fields.get("job_state", "")
    if letter != "F":
        return _PBS_WAITING.get(letter, "UNKNOWN")
    code, substate = int(fields.get("Exit_status", "1")), int(fields.get("substate", "0"))
    if substate == _PBS_DELETED:
        return "CANCELLED"
    if code == _PBS_KILLED_WALLTIME:
        return "TIMEOUT"
    return "COMPLETED" if code == 0 else "FAILED"


def _seconds(text: str) -> float | None:
    """``[D-]HH:MM:SS``, ``MM:SS`` or ``SS`` as seconds; None for anything else (``UNLIMITED``)."""
    found = re.fullmatch(r"(?:(\d+)-)?(?:(?:(\d+):)?(\d+):)?(\d+)", text.strip())
    if not found:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in found.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def time_left(scheduler: str, job_id: str) -> float | None:
    """Seconds before the scheduler ends the running job at its time limit; None when unlimited or unknown."""
    if scheduler == "slurm":
        done = _ask(["squeue", "-h", "-j", job_id, "-o", "%L"])
        return _seconds(done.stdout) if done is not None and done.returncode == 0 else None
    fields = _pbs_record(job_id) or {}
    limit = _seconds(fields.get("Resource_List.walltime", ""))
    started = fields.get("stime")  # local time, as qstat prints it
    if limit is None or not started:
        return None
    try:
        start = time.mktime(time.strptime(started, "%a %b %d %H:%M:%S %Y"))
    except ValueError:
        return None
    return start + limit - time.time()


def cancel(scheduler: str, job_id: str) -> str | None:
    """Ask the scheduler to end the job (``scancel``, ``qdel``); the client's complaint, or None once accepted."""
    done = _ask(["scancel", job_id] if scheduler == "slurm" else ["qdel", job_id])
    if done is None:
        return f"{'scancel' if scheduler == 'slurm' else 'qdel'} could not be run or did not answer"
    return None if done.returncode == 0 else (done.stderr or done.stdout).strip()
