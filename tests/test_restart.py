"""A job restarted after losing a rank resumes from its newest finished checkpoint and ends bitwise equal to a
run never stopped: examples/resumable_training.py under ``torchrun --max-restarts`` on this machine (the
virtual cluster's tests do the same under Slurm's requeue)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _mpijob import FAULT_INJECTION

pytestmark = FAULT_INJECTION
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "resumable_training.py"
STEPS, EVERY = 160, 20
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "PALS_", "PBS_"))}
    return {**env, "OMP_NUM_THREADS": "1"}


def _args(ckpt: Path) -> list[str]:
    return [str(EXAMPLE), "--dir", str(ckpt), "--steps", str(STEPS), "--every", str(EVERY)]


def final_digest(out: str) -> str:
    found = re.findall(rf"FINAL step {STEPS} sha256 ([0-9a-f]{{64}})", out)
    assert len(found) == 1, out[-5000:]
    return found[0]


def worker_pids(ckpt: Path, local_rank: int) -> list[int]:
    """The training processes of the job writing to ``ckpt`` with this local rank (torchrun's workers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(EXAMPLE).encode() in cmd and str(ckpt).encode() in cmd and f"LOCAL_RANK={local_rank}".encode() in env:
            pids.append(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    ckpt = tmp_path_factory.mktemp("uninterrupted")
    out = subprocess.run([*TORCHRUN, *_args(ckpt)], capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "STARTED at step 0" in out.stdout, out.stdout
    return final_digest(out.stdout)


def test_torchrun_restarts_a_killed_rank_and_the_run_ends_bitwise_equal(uninterrupted: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    job = subprocess.Popen([*TORCHRUN, "--max-restarts", "1", *_args(ckpt)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / f"step-{2 * EVERY:08d}").is_dir():
            assert job.poll() is None and time.monotonic() < deadline, "no second checkpoint written"
            time.sleep(0.05)
        victims = worker_pids(ckpt, 1)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        for pid in worker_pids(ckpt, 0) + worker_pids(ckpt, 1):  # torchrun starts each in a session of its own
            os.kill(pid, signal.SIGKILL)
    assert job.returncode == 0, out[-5000:]
    resumed = [int(s) for s in re.findall(r"RESUMED at step (\d+) of \d+ on 2 ranks \(TORCHELASTIC_RESTART_COUNT=1\)",
                                          out)]
    assert len(resumed) == 1 and 2 * EVERY <= resumed[0] < STEPS, out[-5000:]
    assert final_digest(out) == uninterrupted
