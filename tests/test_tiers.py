"""The two tiers of tests: `make test` leaves out what needs the virtual cluster, Spack, vendored builds or more MPI
ranks and says so at its end, naming `make test-all`; `make test-all` runs all of it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_TWO_TIERS = '''import pytest


def test_quick():
    assert True


@pytest.mark.full("the virtual cluster under Slurm")
def test_on_the_cluster():
    assert True


@pytest.mark.full("the virtual cluster under Slurm")
@pytest.mark.parametrize("n", [1, 2])
def test_twice_on_the_cluster(n):
    assert n


@pytest.mark.full("Spack")
def test_with_spack():
    assert True
'''


def _pytest(where: Path, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
                           "--rootdir", str(where), *args, str(where)], capture_output=True, text=True, timeout=120,
                          cwd=where, env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_first_tier_names_what_it_left_out_and_the_command_that_runs_it(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_two_tiers.py").write_text(_TWO_TIERS)
    first = _pytest(tmp_path)
    assert "1 passed, 4 deselected" in first, first
    assert "4 tests of the second tier were not run; `make test-all` runs them" in first, first
    assert "     3  need the virtual cluster under Slurm\n" in first and "     1  need Spack\n" in first, first
    assert "the first tier's budget on 2 cores: 600 s" in first, first
    everything = _pytest(tmp_path, "-m", "")
    assert "5 passed" in everything and "not run here" not in everything, everything


def test_what_needs_a_cluster_spack_or_more_ranks_is_in_the_second_tier() -> None:
    """Collected as `make test` collects: no test of the virtual cluster, the host's Slurm, the real Spack, the
    vendored plugin build, PyTorch's own backend and suite, fault injection or 33 ranks, and the MPI suites at 2
    ranks only (or a file's smallest count above it), under MPICH too."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = [line for line in proc.stdout.splitlines() if "::" in line]
    assert len(first) > 300, proc.stdout[-3000:]
    for heavy in ("test_vcluster.py", "test_vcluster_pbs.py", "test_cluster_slurm.py", "test_nccl_ofi_plugin.py",
                  "test_mpi_upstream.py", "test_torch_suite.py", "test_accl_many_ranks.py", "test_survivors_fail_fast_",
                  "test_restart.py", "test_pinned_spack_", "test_fake_install_"):
        assert not [t for t in first if heavy in t], f"{heavy} in the first tier"
    suites = [t.split("[")[1].rstrip("]") for t in first if "test_mpi_suites.py::test_mpi_suite[" in t]
    assert suites and all("-np2" in s or s == "test_workloads_mesh-np4" for s in suites), suites
    assert any(s.endswith("-np2-mpich") for s in suites), suites
