"""The PyTorch version table from the user's side: `make cluster-versions`, a build of the newest row as a PBS
dry run, and the error for a release that is not in the table."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


def table() -> list[dict[str, str]]:
    lines = [ln.split("\t") for ln in (ROOT / "utils/pytorch_versions.tsv").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    return [dict(zip(lines[0], row, strict=True)) for row in lines[1:]]


def make(tmp_path: Path, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C",
            "TORCHHPC_PREFIX": str(tmp_path / "build")}
    proc = subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, env={**base, **env},
                          capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_table_has_every_minor_release_from_2_4_to_2_13() -> None:
    versions = [row["torch"] for row in table()]
    minors = [tuple(int(x) for x in v.split(".")[:2]) for v in versions]
    assert minors == [(2, m) for m in range(4, 14)], "one row per minor release 2.4 .. 2.13, in order"
    assert versions[0] == "2.4.1" and versions[-1] == "2.13.0"
    for row in table():
        assert len(row["commit"]) == 40 and all(c in "0123456789abcdef" for c in row["commit"])
        low, high = (tuple(int(x) for x in bound.lstrip("<=>").split(".")) for bound in row["python_range"].split(","))
        assert low <= tuple(int(x) for x in row["python"].split(".")) <= high, f"{row['torch']}: python out of range"


def test_make_cluster_versions_lists_every_row_with_its_sources(tmp_path: Path) -> None:
    out = make(tmp_path, "cluster-versions").stdout
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["torch", "torchvision", "cuda", "cudnn", "nccl"]
    for row in table():
        assert any(line.split()[:5] == [row["torch"], row["torchvision"], row["cuda"], row["cudnn"], row["nccl"]]
                   for line in lines), f"{row['torch']} missing from make cluster-versions"
    assert "Where each figure comes from" in out and "RELEASE.md" in out and "PyPI torch==2.4.1" in out


def test_sources_of_one_release(tmp_path: Path) -> None:
    proc = subprocess.run(["utils/pytorch_version.sh", "--sources", "2.13.0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0
    fields = {line.split()[0] for line in proc.stdout.splitlines()}
    assert {"torchvision", "cuda", "cudnn", "nccl", "python_range", "cxx", "gcc_min", "commit"} <= fields
    bad = subprocess.run(["utils/pytorch_version.sh", "--sources", "2.3.1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 1 and "2.13.0" in bad.stderr


def test_newest_release_builds_as_a_pbs_job_dry_run(tmp_path: Path) -> None:
    out = make(tmp_path, "build-pytorch-v2.13.0-pbs", "SITE=derecho", "DRY_RUN=1", PBS_ACCOUNT="NTDD0001").stdout
    assert "#PBS -N torchhpc-build-v2.13.0" in out
    assert "export SITE=derecho PYTORCH_VERSION=2.13.0" in out
    assert "qcmd -N torchhpc-build-v2.13.0" in out


def test_unknown_release_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    proc = make(tmp_path, "build-pytorch-v2.3.0-pbs", "SITE=derecho", "DRY_RUN=1", check=False,
                PBS_ACCOUNT="NTDD0001")
    assert proc.returncode != 0
    assert "PyTorch 2.3.0 is not supported" in proc.stderr
    assert all(row["torch"] in proc.stderr for row in table())
