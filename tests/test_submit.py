"""torchhpc.submit without a scheduler: the in-job side under a real mpiexec on this machine, what comes back
through the call's folder, and what is refused there.  The schedulers themselves (sbatch, qsub, requeue, cancel,
walltime) are exercised on the virtual cluster (tests/test_vcluster.py, tests/test_vcluster_pbs.py); here the
scheduler's answer is fixed where a Job needs one, and PBS's record is a file in qstat's format."""

from __future__ import annotations

import os
import socket
import stat
import sys
from pathlib import Path

import pytest
from _mpijob import run_mpi

from torchhpc.submit import Executor, Job, JobError, folder, job_environment, maybe_requeue, scheduler

SPEC = {"name": "t", "init": False, "warn_s": 0, "submit": ["false"], "env": {}, "workdir": "/"}


def ranks_say_where() -> dict:
    env = job_environment()
    if env.rank == 1 and env.world_size > 2:
        raise KeyError("rank 1 has no such key")
    maybe_requeue()  # no time limit known, no checkpoint hook: returns
    return {"rank": env.rank, "nodes": env.nodes, "world": env.world_size, "attempt": env.attempt}


def submitted(tmp_path: Path, fn, *args) -> Job:  # noqa: ANN001
    where = folder.create(tmp_path / "runs", "t")
    folder.write_call(where, fn, args, {}, SPEC)
    (where / "jobs").write_text("JOB_SCHEDULER=slurm JOB_ID=17 JOB_LOG=/nowhere/t-17.log\n")
    return Job(where, "t")


@pytest.fixture()
def ended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler, "state", lambda sched, job_id: "COMPLETED")


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_rank_runs_the_call_and_its_outcome_comes_back(tmp_path: Path, ended: None, ranks: int) -> None:
    """mpiexec starts the worker on each rank: each writes its return value (2 ranks), or rank 1 its error with
    its traceback and host, re-raised by result() from the original exception (3 ranks)."""
    job = submitted(tmp_path, ranks_say_where)
    done = run_mpi(ranks, [sys.executable, "-m", "torchhpc.submit", str(job.folder)], timeout=120)
    assert (done.returncode == 0) == (ranks == 2), done.stdout  # the failing rank ended the job
    assert "torchhpc.submit: rank 0 of" in job.stdout(0) and "no time limit known" in job.stdout(0)
    if ranks == 2:
        host = socket.gethostname()
        assert job.results() == [{"rank": r, "nodes": (host,), "world": 2, "attempt": 1} for r in range(2)]
        assert job.exception() is None and job.result()["rank"] == 0
        return
    with pytest.raises(JobError, match=r"job 17 \(t\): rank 1 on \S+ raised KeyError") as caught:
        job.result()
    assert "rank 1's traceback" in str(caught.value) and "in ranks_say_where" in str(caught.value)
    assert isinstance(caught.value.__cause__, KeyError)
    assert "KeyError" in job.stderr(1)


def test_a_result_another_user_could_write_is_refused(tmp_path: Path, ended: None) -> None:
    """Results are unpickled: one writable by others, or owned by another user, is never loaded."""
    job = submitted(tmp_path, ranks_say_where)
    folder.write_json(job.folder, "world.json", {"world_size": 1})
    folder.write_outcome(job.folder, 0, {"ok": True, "value": 42})
    assert job.result() == 42
    result = job.folder / "rank-0.result"
    os.chmod(result, 0o666)
    with pytest.raises(JobError, match=r"rank 0's result is not read: .* lets others write it"):
        job.result()
    os.chmod(result, 0o600)
    if os.geteuid() == 0:
        os.chown(result, 65534, 65534)
        with pytest.raises(JobError, match=r"owned by uid 65534"):
            job.result()
    os.chmod(job.folder, 0o755)
    with pytest.raises(Exception, match=r"lets others reach it"):
        job.result()


def test_a_truncated_or_missing_result_names_the_job_and_rank(tmp_path: Path, ended: None) -> None:
    job = submitted(tmp_path, ranks_say_where)
    with pytest.raises(JobError, match=r"job 17 \(t\) ended COMPLETED before its ranks started.*t-17.log"):
        job.result()
    folder.write_json(job.folder, "world.json", {"world_size": 2})
    folder.write_outcome(job.folder, 0, {"ok": True, "value": list(range(1000))})
    with pytest.raises(JobError, match=r"ended COMPLETED before rank 1 returned.*rank-1.err"):
        job.result()
    data = (job.folder / "rank-0.result").read_bytes()
    (job.folder / "rank-0.result").write_bytes(data[: len(data) // 2])
    with pytest.raises(JobError, match=r"job 17 \(t\): rank 0's result .* cannot be read back"):
        job.result()


def test_the_call_folder_is_private_and_its_files_closed(tmp_path: Path) -> None:
    job = submitted(tmp_path, ranks_say_where)
    assert stat.S_IMODE(os.stat(job.folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(job.folder.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(job.folder / "call.pkl").st_mode) == 0o600
    with pytest.raises(FileExistsError):
        folder.create(tmp_path / "runs", "t")


def test_a_cancelled_job_is_cancelled_whatever_its_scheduler_recorded(tmp_path: Path, ended: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """qdel as a job starts: OpenPBS may record an ordinary exit (here: COMPLETED).  A call cancel() ended before
    its ranks all returned is CANCELLED; one whose ranks had all returned keeps its scheduler's word."""
    monkeypatch.setattr(scheduler, "cancel", lambda sched, job_id: None)
    job = submitted(tmp_path, ranks_say_where)
    assert job.wait() == "COMPLETED"
    job.cancel()
    assert job.wait() == "CANCELLED"
    with pytest.raises(JobError, match=r"ended CANCELLED before its ranks started: it was cancelled \(scancel/qdel\)"):
        job.result()
    folder.write_json(job.folder, "world.json", {"world_size": 1})
    assert job.wait() == "CANCELLED"  # started, rank 0 not returned
    folder.write_outcome(job.folder, 0, {"ok": True, "value": 7})
    assert job.wait() == "COMPLETED" and job.result() == 7


def test_outside_a_job_the_in_job_calls_say_so() -> None:
    with pytest.raises(JobError, match="not inside a job submitted with torchhpc.submit"):
        job_environment()
    with pytest.raises(JobError, match="not inside a job"):
        maybe_requeue()


def test_bad_executor_options_are_named() -> None:
    with pytest.raises(ValueError, match="scheduler must be 'pbs' or 'slurm', got 'lsf'"):
        Executor(scheduler="lsf")
    with pytest.raises(ValueError, match="env must be"):
        Executor(env="mine")
    with pytest.raises(TypeError, match="needs a callable, got int"):
        Executor().submit(3)


PBS_RECORD = """Job Id: 12.node1
    Job_Name = t
    job_state = {state}
    substate = {substate}
    Exit_status = {code}
    Resource_List.walltime = 00:10:00
    stime = {stime}
"""


@pytest.mark.parametrize(("state", "substate", "code", "word"), [
    ("Q", 10, 0, "PENDING"), ("R", 42, 0, "RUNNING"), ("F", 92, 0, "COMPLETED"), ("F", 92, 3, "FAILED"),
    ("F", 92, -29, "TIMEOUT"), ("F", 91, 271, "CANCELLED")])
def test_pbs_states_in_slurms_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: str, substate: int,
                                    code: int, word: str) -> None:
    """PBS's letter, substate and exit status as the one word a Job reports (the record: qstat -x -f's format,
    from a stand-in qstat; the real OpenPBS runs on the virtual cluster)."""
    import time

    record = tmp_path / "record"
    started = time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(time.time() - 60))
    record.write_text(PBS_RECORD.format(state=state, substate=substate, code=code, stime=started))
    qstat = tmp_path / "qstat"
    qstat.write_text(f"#!/bin/sh\ncat {record}\n")
    qstat.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert scheduler.state("pbs", "12.node1") == word
    assert 530 <= scheduler.time_left("pbs", "12.node1") <= 541
