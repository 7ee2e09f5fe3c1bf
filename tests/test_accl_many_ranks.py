"""all_to_all past 32 ranks on one node, where its byte matrix no longer rides with the header exchange: each rank
checks its own column and the ranks agree on the verdict (33 oversubscribed ranks, both MPI wheels; about a minute
each on 2 cores: the second tier, ``make test-all``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _mpijob import run_mpi

JOB = Path(__file__).with_name("accl_many_ranks_job.py")
pytestmark = pytest.mark.full("33 MPI ranks")


@pytest.mark.parametrize("variant", ["plain", "mpich"])
def test_all_to_all_at_33_ranks_checks_columns_and_names_a_mismatched_pair(variant: str) -> None:
    res = run_mpi(33, [sys.executable, str(JOB)], timeout=420, variant=variant)
    out = res.stdout  # stderr joined in
    assert res.returncode == 0, out[-4000:]
    # rank 32 expects 1 + 1 elements (8 bytes) more from rank 0 than rank 0 sends it: (0 + 32) % 3 + 1 = 3 floats
    assert ("OK accl: all_to_all split sizes do not match across ranks: rank 0 sends 12 bytes to rank 32, which "
            "expects 16 bytes from it (1 mismatched pairs)") in out, out[-4000:]
