"""Slow preparations that only some second-tier tests need (OpenPBS's build, the Spack concretizations), started
as the session starts and run beside the tests before them at the lowest CPU priority, so that they cost the run
idle CPU instead of minutes of their own; the test that needs one waits for it.

A test module asks for one with a function ``start_in_background(items)`` (its selected tests), which
tests/conftest.py calls once after collection; the module's fixture then calls ``wait(name, timeout)``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from _mpijob import kill_session

# A background job is a session of its own, so its scheduler autogroup gets nice 19 too: the kernel weighs
# autogroups against each other before it looks at a process's nice, and at nice 0 the group would take a core from
# the tests (seen: the Slurm examples beside OpenPBS's build 18-20 s slower each, 39-44 s against 18-26 s).
# Where there are no autogroups, nice alone.
_LOWEST = 'echo 19 2>/dev/null >/proc/self/autogroup; exec nice -n 19 "$0" "$@"'
_JOBS: dict[str, subprocess.Popen] = {}


def start(name: str, argv: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    """Run ``argv`` in the background at the lowest priority, its output in ``log``; once per session."""
    if name in _JOBS:
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        _JOBS[name] = subprocess.Popen(["bash", "-c", _LOWEST, *argv], stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, cwd=cwd, env=env, start_new_session=True)


def wait(name: str, timeout: float) -> int | None:
    """The exit status of background job ``name`` once it ended, waiting at most ``timeout`` s (a job still running
    then is killed); None where it was never started.  The caller then does its own preparation, a no-op where
    the background one succeeded, which shows any failure."""
    job = _JOBS.pop(name, None)
    if job is None:
        return None
    try:
        return job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(job.pid)
        return job.wait()


def stop_all() -> None:
    """Kill what no test waited for (a session stopped early): nothing of it outlives the session."""
    for name in list(_JOBS):
        wait(name, 0.01)
