"""The native build infrastructure (utils/native/common.sh, `make native-*`): verified sources, clear errors, stamps."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENDOR = ROOT.parent / "shared" / "vendor"
COMMON = ROOT / "utils" / "native" / "common.sh"


def bash(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Run ``script`` after sourcing common.sh, with NATIVE_PREFIX in tmp_path."""
    full = {**os.environ, "NATIVE_PREFIX": str(tmp_path / "prefix"), "NATIVE_SOURCES": "", **env}
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source {COMMON}; {script}"], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=120)


def test_every_row_of_the_table_is_complete(tmp_path: Path) -> None:
    names = [line.split("\t")[0] for line in (ROOT / "utils" / "native_versions.tsv").read_text().splitlines()
             if line and not line.startswith("#")]
    assert {"argobots", "mercury", "margo", "thallium", "xbraid"} <= set(names)
    for name in names:
        r = bash(f'native_row {name}; echo "$ROW_VERSION $ROW_TAG $ROW_COMMIT $ROW_ARCHIVE"', tmp_path)
        assert r.returncode == 0, r.stderr
        version, tag, commit, archive = r.stdout.split()
        assert len(commit) == 40 and archive.endswith(".tar.gz") and version in tag


@pytest.mark.skipif(not VENDOR.is_dir(), reason=f"no offline archives at {VENDOR}")
def test_vendor_archive_is_verified_and_used(tmp_path: Path) -> None:
    r = bash("native_fetch thallium", tmp_path, NATIVE_SOURCES=str(VENDOR))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(VENDOR / "mochi-thallium-0.16.0.tar.gz")


def test_an_archive_of_another_commit_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "sources"
    (src / "argobots-1.2").mkdir(parents=True)
    (src / "argobots-1.2" / "README").write_text("not the pinned commit\n")
    with tarfile.open(src / "argobots-1.2.tar.gz", "w:gz") as tar:
        tar.add(src / "argobots-1.2", arcname="argobots-1.2")
    r = bash("native_fetch argobots", tmp_path, NATIVE_SOURCES=str(src))
    assert r.returncode != 0
    assert "is not argobots v1.2" in r.stderr and "6d216a9f546f0a0024a4fe0e8548aeaf51520d4a" in r.stderr


@pytest.mark.skipif(not VENDOR.is_dir(), reason=f"no offline archives at {VENDOR}")
def test_archives_are_checked_by_their_files_not_by_a_comment(tmp_path: Path) -> None:
    """`git get-tar-commit-id` read a comment anyone can write: one changed file under the pinned commit's id
    was accepted.  The tree digest refuses it, and accepts the same files packed as GitHub packs them."""
    with tarfile.open(VENDOR / "mochi-thallium-0.16.0.tar.gz") as tar:
        tar.extractall(tmp_path / "x", filter="tar")
        comment = tar.pax_headers.get("comment", "")
    assert len(comment) == 40, "the vendor archive carries git's commit comment"
    top = tmp_path / "x" / "mochi-thallium-0.16.0"
    for name, change in (("repacked", None), ("tampered", "CMakeLists.txt")):
        if change:
            (top / change).write_text((top / change).read_text() + "\n# planted\n")
        src = tmp_path / name
        src.mkdir()
        with tarfile.open(src / "mochi-thallium-0.16.0.tar.gz", "w:gz", format=tarfile.PAX_FORMAT,
                          pax_headers={"comment": comment}) as tar:  # the commit id says "pinned" both times
            tar.add(top, arcname=f"mochi-thallium-{comment}")  # GitHub's top folder, other gzip bytes
        r = bash("native_fetch thallium", tmp_path, NATIVE_SOURCES=str(src))
        if change:
            assert r.returncode != 0 and "its files hash to" in r.stderr, r.stderr
        else:
            assert r.returncode == 0, r.stderr


def test_missing_build_dependencies_are_listed_together(tmp_path: Path) -> None:
    r = bash("native_require cmake:cmd=no-such-cmake:cmake json-c:h=no/such/json.h:libjson-c-dev "
             "bash:cmd=bash:bash", tmp_path)
    assert r.returncode != 0
    assert "missing build dependencies: cmake json-c." in r.stderr
    assert "apt-get install cmake libjson-c-dev" in r.stderr


def test_unknown_part_is_a_clear_error() -> None:
    r = subprocess.run(["make", "native-nosuchpart"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no native part 'nosuchpart'" in r.stderr and "native-mochi" in r.stderr


def test_a_built_stack_is_not_rebuilt(tmp_path: Path) -> None:
    prefix = ROOT / ".venv" / "native"
    if not (prefix / "stamps" / "thallium").is_file():
        pytest.skip("the Mochi stack is not built here (make native-mochi)")
    r = subprocess.run(["make", "native-mochi"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("argobots", "mercury", "margo", "thallium"):
        assert f"{name} " in r.stderr and "stamp matches" in r.stderr
    assert "extension _torchhpc_thallium is up to date" in r.stderr
    assert "+ cmake" not in r.stderr and "+ make" not in r.stderr
