"""The PyTorch patches: manifest, diff well-formedness, applying to upstream text, and the patched code run.

The CUDA-awareness fix is compiled and executed here: against the real Open MPI of the local environment,
and against a minimal stand-in of MPICH's mpi.h GPU-query API (the MPICH/Cray libraries are the boundary
we cannot install here) to drive each preprocessor branch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches" / "pytorch"
UPSTREAM = ROOT / "tests" / "data" / "pytorch" / "ProcessGroupMPI.cpp.head"
PG_MPI = "torch/csrc/distributed/c10d/ProcessGroupMPI.cpp"
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def version_table() -> dict[str, str]:
    """torch version -> patch directory, from utils/pytorch_versions.tsv."""
    rows = {}
    for line in (ROOT / "utils" / "pytorch_versions.tsv").read_text().splitlines():
        cols = line.split("\t")
        if line.startswith("#") or not line.strip() or cols[0] == "torch":
            continue
        rows[cols[0]] = cols[6]
    return rows


def manifest() -> list[tuple[str, str, list[str]]]:
    rows = []
    for line in (PATCHES / "MANIFEST").read_text().splitlines():
        if line.startswith("#") or not line.strip() or line.startswith("version\t"):
            continue
        version, patch, files, _verified = line.split("\t")
        rows.append((version, patch, files.split(",")))
    return rows


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


def test_every_supported_version_has_patches_listed_in_the_manifest() -> None:
    rows = manifest()
    listed = {(v, p) for v, p, _ in rows}
    for version, patch_dir in version_table().items():
        on_disk = sorted(p.name for p in (PATCHES / patch_dir).glob("*.patch"))
        assert on_disk, f"no patches for PyTorch {version}"
        assert {(patch_dir, p) for p in on_disk} <= listed, f"unlisted patch in {patch_dir}"
    for version, patch, _ in rows:
        assert (PATCHES / version / patch).is_file(), f"MANIFEST names a missing patch {version}/{patch}"


@pytest.mark.parametrize(("version", "patch", "files"), manifest())
def test_patch_is_well_formed_documented_and_touches_the_manifest_files(
    version: str, patch: str, files: list[str]
) -> None:
    text = (PATCHES / version / patch).read_text()
    assert re.match(r"\d{4}-[a-z0-9-]+\.patch$", patch), "patches are applied in file-name order: NNNN-name"
    header = text.split("\ndiff --git ")[0]
    assert "Subject:" in header and len(header.splitlines()) >= 5, "the patch must say what it fixes and why"
    assert touched_files(text) == files
    assert all(f.startswith(("torch/", "aten/", "c10/", "caffe2/", "cmake/", "third_party/")) for f in files)


def apply_to_upstream(tmp_path: Path, version: str, tool: str) -> Path:
    tree = tmp_path / "pytorch"
    target = tree / PG_MPI
    target.parent.mkdir(parents=True)
    shutil.copy(UPSTREAM, target)
    for patch in sorted((PATCHES / version).glob("*.patch")):
        if tool == "git":
            # --unsafe-paths: tmp_path may sit inside another git work tree.
            proc = subprocess.run(["git", "apply", "--verbose", "--unsafe-paths", str(patch)], cwd=tree,
                                  capture_output=True, text=True, timeout=30)
        else:
            proc = subprocess.run(["patch", "-p1", "--fuzz=0", "--forward", "-i", str(patch)], cwd=tree,
                                  capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "fuzz" not in (proc.stdout + proc.stderr).lower()
    return target


@pytest.mark.parametrize("tool", ["git", "patch"])
@pytest.mark.parametrize("version", sorted(set(version_table().values())))
def test_patches_apply_to_upstream_text(tmp_path: Path, version: str, tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not installed")
    patched = apply_to_upstream(tmp_path, version, tool).read_text()
    assert "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported)" in patched
    assert 'std::getenv("MPICH_GPU_SUPPORT_ENABLED")' in patched
    # The Open MPI query is kept, and nothing returns true without asking the library or the user.
    fn = patched[patched.index("bool cudaAwareMpiCheck() {"):patched.index("// Checking the input tensor")]
    assert "MPIX_Query_cuda_support() == 1" in fn and "return true;" in fn
    assert fn.count("return true;") == 1
    # Applying twice is refused (the build script relies on this to detect a tree patched before).
    again = subprocess.run(["patch", "-p1", "--dry-run", "--forward", "-i",
                            str(next((PATCHES / version).glob("*.patch")))],
                           cwd=tmp_path / "pytorch", capture_output=True, text=True, timeout=30)
    assert again.returncode != 0


def extract_function(source: str, signature: str = "bool cudaAwareMpiCheck() {") -> str:
    start = source.index(signature)
    end = source.index("\n}\n", start) + 3
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
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  std::printf("aware=%%d\n", cudaAwareMpiCheck() ? 1 : 0);
#if defined(MPIX_CUDA_AWARE_SUPPORT) || defined(HARNESS_REAL_MPICH)
  std::printf("library=%%d\n", MPIX_Query_cuda_support());
#endif
  MPI_Finalize();
  return 0;
}
"""

# Stand-in for MPICH's mpi.h: only the names the patched function uses, with MPICH's values
# (MPIX_GPU_SUPPORT_CUDA is 0 in MPICH). The query answers from STANDIN_GPU_QUERY: "1"/"0", or "error".
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


@pytest.fixture(scope="module")
def patched_function(tmp_path_factory: pytest.TempPathFactory) -> str:
    version = sorted(set(version_table().values()))[-1]
    return extract_function(apply_to_upstream(tmp_path_factory.mktemp("pt"), version, "patch").read_text())


def run_binary(binary: Path, **env: str) -> dict[str, str]:
    """Run a harness binary with exactly the switches in `env` (none inherited) and parse key=value lines."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("MPICH_GPU_SUPPORT_ENABLED", "STANDIN_GPU_QUERY")}
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60, env={**base, **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(line.split("=", 1) for line in proc.stdout.split())


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize(
    ("defines", "env", "expected"),
    [
        # MPICH >= 4 / Cray MPICH 8: the library's answer wins over the environment variable.
        ("#define MPICH_VERSION \"4.1.2\"\n#define MPIX_GPU_SUPPORT_CUDA (0)",
         {"STANDIN_GPU_QUERY": "1"}, "1"),
        ("#define MPICH_VERSION \"4.1.2\"\n#define MPIX_GPU_SUPPORT_CUDA (0)",
         {"STANDIN_GPU_QUERY": "0", "MPICH_GPU_SUPPORT_ENABLED": "1"}, "0"),
        ("#define MPICH_VERSION \"4.1.2\"\n#define MPIX_GPU_SUPPORT_CUDA (0)",
         {"STANDIN_GPU_QUERY": "error", "MPICH_GPU_SUPPORT_ENABLED": "1"}, "0"),
        # MPICH-derived without the query: the runtime switch decides, and only "1" means yes.
        ("#define MPICH_VERSION \"3.4a2\"", {"MPICH_GPU_SUPPORT_ENABLED": "1"}, "1"),
        ("#define MPICH_VERSION \"3.4a2\"", {"MPICH_GPU_SUPPORT_ENABLED": "0"}, "0"),
        ("#define MPICH_VERSION \"3.4a2\"", {}, "0"),
        # Neither Open MPI nor MPICH-derived: never CUDA-aware, whatever the environment says.
        ("", {"MPICH_GPU_SUPPORT_ENABLED": "1"}, "0"),
    ],
    ids=["mpich4-query-yes", "mpich4-query-no", "mpich4-query-error", "mpich3-env-1", "mpich3-env-0",
         "mpich3-no-env", "other-mpi"],
)
def test_patched_check_against_mpich_api_standin(
    tmp_path: Path, patched_function: str, defines: str, env: dict[str, str], expected: str
) -> None:
    (tmp_path / "mpi.h").write_text(STANDIN_MPI_H % {"defines": defines})
    src = tmp_path / "check.cpp"
    src.write_text(HARNESS % {"stub": STANDIN_QUERY, "function": patched_function})
    binary = tmp_path / "check"
    cxx = ["g++", "-std=c++17", "-Wall", "-Werror", "-I", str(tmp_path), str(src), "-o", str(binary)]
    subprocess.run(cxx, check=True, capture_output=True, text=True, timeout=120)
    assert run_binary(binary, **env)["aware"] == expected


def test_patched_check_with_real_open_mpi(tmp_path: Path, patched_function: str) -> None:
    """Open MPI keeps its own query: the result is the library's, and MPICH's switch does not change it."""
    mpicxx = Path(sys.executable).parent / "mpicxx"
    if not mpicxx.exists():
        mpicxx = Path(shutil.which("mpicxx") or "/nonexistent")
    if not mpicxx.exists():
        pytest.skip("no mpicxx (run `make env`)")
    src = tmp_path / "check.cpp"
    src.write_text(HARNESS % {"stub": "", "function": patched_function})
    binary = tmp_path / "check"
    proc = subprocess.run([str(mpicxx), "-std=c++17", str(src), "-o", str(binary)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    probe = subprocess.run([str(mpicxx), "-showme:version"], capture_output=True, text=True, timeout=30)
    if "Open MPI" not in probe.stdout + probe.stderr:
        pytest.skip("mpicxx is not Open MPI")
    plain = run_binary(binary)
    with_switch = run_binary(binary, MPICH_GPU_SUPPORT_ENABLED="1")
    assert plain["aware"] == plain["library"] == with_switch["aware"]


def mpich_compilers() -> list[list[str]]:
    """Ways to compile against an installed MPICH: its C++ wrapper (Debian's mpicxx.mpich, or the mpicxx
    next to mpichversion), as a command prefix."""
    found = []
    for wrapper in (shutil.which("mpicxx.mpich"), shutil.which("mpichversion")):
        if wrapper is None:
            continue
        if wrapper.endswith("mpichversion"):
            wrapper = str(Path(wrapper).parent / "mpicxx")
        if Path(wrapper).exists():
            show = subprocess.run([wrapper, "-show"], capture_output=True, text=True, timeout=30)
            if show.returncode == 0 and "mpich" in show.stdout.lower():
                found.append([wrapper])
    return found


def test_patched_check_with_real_mpich(tmp_path: Path, patched_function: str) -> None:
    """With an MPICH installed, the MPICH branch is compiled against its mpi.h and asks the library."""
    compilers = mpich_compilers()
    if not compilers:
        pytest.skip("no MPICH compiler wrapper here; the stand-in tests above cover the MPICH branches")
    src = tmp_path / "check.cpp"
    src.write_text(HARNESS % {"stub": "", "function": patched_function})
    binary = tmp_path / "check"
    cxx = [*compilers[0], "-std=c++17", "-Wall", "-Werror", "-DHARNESS_REAL_MPICH", str(src),
           "-o", str(binary)]
    proc = subprocess.run(cxx, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plain = run_binary(binary)
    with_switch = run_binary(binary, MPICH_GPU_SUPPORT_ENABLED="1")
    # MPICH has the query, so its answer stands whatever MPICH_GPU_SUPPORT_ENABLED says.
    assert plain["aware"] == plain["library"] == with_switch["aware"]
