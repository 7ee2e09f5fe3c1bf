"""tests/all_reduce_test.py: runs and checks itself at 2 and 4 ranks; its checker catches wrong sums."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from _mpijob import run_mpi
from _scripts import load_script

SCRIPT = Path(__file__).with_name("all_reduce_test.py")
art = load_script("tests/all_reduce_test.py")


@pytest.mark.parametrize("backend", ["gloo", "accl"])
@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=pytest.mark.full("4 MPI ranks"))])
def test_script_under_mpiexec(backend: str, nprocs: int) -> None:
    res = run_mpi(nprocs, [sys.executable, str(SCRIPT), "--backend", backend, "-b", "8", "-e", "256K", "-f", "4",
                           "-w", "1", "-n", "3", "--timeout", "60"], timeout=120)
    assert res.returncode == 0, res.stdout
    rows = [line.split() for line in res.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\s+float", line)]
    assert [int(r[0]) for r in rows] == [8, 32, 128, 512, 2048, 8192, 32768, 131072], res.stdout
    for size, count, _type, op, time_us, algbw, busbw, wrong in rows:
        assert int(count) == int(size) // 4 and op == "sum" and wrong == "0"
        assert float(time_us) > 0
        assert abs(float(busbw) - float(algbw) * 2 * (nprocs - 1) / nprocs) <= 0.002
    assert f"backend {backend}, {nprocs} ranks" in res.stdout
    assert "# Out of bounds values : 0 OK" in res.stdout


@pytest.mark.parametrize("dtype", list(art.DTYPES.values()))
@pytest.mark.parametrize("world_size", [1, 2, 8, 64])
def test_checker_accepts_right_sums_and_catches_wrong_ones(dtype: torch.dtype, world_size: int) -> None:
    total = torch.zeros(1000, dtype=torch.float64)
    for r in range(world_size):
        contribution = torch.empty(1000, dtype=dtype)
        art.fill(contribution, r)
        total += contribution.double()
    result = total.to(dtype)
    assert art.count_wrong(result, world_size) == 0
    result[17] += 1 if not dtype.is_floating_point else result[17] * 0.25 + 1
    result[999] = 0
    assert art.count_wrong(result, world_size) == 2


def test_sizes_and_size_parsing() -> None:
    assert art.sizes(8, 64, 2, 4) == [8, 16, 32, 64]
    assert art.sizes(1, 8, 2, 8) == [8]
    assert art.parse_size("64M") == 64 << 20 and art.parse_size("1k") == 1024 and art.parse_size("8") == 8
    with pytest.raises(Exception, match="not a size"):
        art.parse_size("lots")


def test_bad_arguments_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        art.parse_args(["--minbytes", "1M", "--maxbytes", "1K"])
    assert "--minbytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        art.parse_args(["--backend", "nccl", "--device", "cpu"])
