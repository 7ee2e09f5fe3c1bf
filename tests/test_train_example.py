"""examples/train.py, the training template: under mpiexec it trains on accl, checkpoints and resumes where an
uninterrupted run would be; under torchrun it takes gloo.  (Slurm's srun and PBS's qsub run it across the virtual
cluster's nodes in test_vcluster.py and test_vcluster_pbs.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from _mpijob import run_mpi

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"


def final_loss(out: str, steps: int) -> str:
    found = re.findall(rf"done: {steps} steps, mean final loss ([\d.]+), median (\d+) samples/s on 2 ranks", out)
    assert len(found) == 1 and int(found[0][1]) > 0, out[-3000:]
    return found[0][0]


def train(ckpt: Path, steps: int) -> str:
    proc = run_mpi(2, [sys.executable, str(TRAIN), "--steps", str(steps), "--every", "10", "--log-every", "10",
                       "--width", "64", "--ckpt", str(ckpt)], timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def test_under_mpiexec_it_trains_on_accl_and_resumes_where_it_stopped(tmp_path: Path) -> None:
    whole = train(tmp_path / "whole", 30)
    assert "starting at step 0 of 30: 2 ranks, backend accl, device cpu" in whole, whole[-3000:]
    assert re.search(r"ranks on hosts: 0:\S+ 1:\S+", whole), whole[-3000:]
    assert len(re.findall(r"step +\d+  loss [\d.]+ +[\d.]+ ms/step +\d+ samples/s", whole)) == 3, whole[-3000:]
    final_loss(train(tmp_path / "split", 20), 20)
    rest = train(tmp_path / "split", 30)
    assert "resumed at step 20 of 30" in rest, rest[-3000:]
    assert final_loss(rest, 30) == final_loss(whole, 30), (rest[-2000:], whole[-2000:])


def test_under_torchrun_it_takes_gloo(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(TRAIN), "--steps", "10", "--log-every", "5", "--width", "64", "--ckpt", str(tmp_path)],
                          capture_output=True, text=True, timeout=180, env=_plain_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "backend gloo, device cpu" in proc.stdout and "done: 10 steps" in proc.stdout, proc.stdout


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "PALS_"))}
