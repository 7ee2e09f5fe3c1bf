"""accl's C++ backend (``csrc/``, issue 24): built per MPI family against the installed torch with
-Wall -Wextra -Werror, kept when its stamp says nothing changed, loaded for the library mpi4py loaded and
refused when built for another torch or library."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchhpc.accl import core, corebuild
from torchhpc.runtime.errors import EngineUnavailableError

VENV_BIN = Path(sys.executable).parent


@pytest.mark.parametrize("mpicc", [VENV_BIN / "mpicc", VENV_BIN.parent / "mpich" / "bin" / "mpicc"])
def test_make_env_built_each_family_from_these_sources(mpicc: Path) -> None:
    """``make env`` built a module per MPI family (with -Werror) from the sources as they are now: a build asked
    again keeps it (the stamp names torch and hashes every file of csrc/), so an edit without a rebuild fails here."""
    if not mpicc.exists():
        pytest.skip(f"no {mpicc} (make env installs both MPI wheels)")
    fam = corebuild.family_of(str(mpicc))
    before = list(corebuild.CSRC.parent.glob(f"_backend_{fam}.*.so"))
    assert len(before) == 1, f"make env built no single _backend_{fam} module: {before}"
    mtime = before[0].stat().st_mtime_ns
    assert corebuild.build(str(mpicc), test_hooks=True) == before[0]
    assert before[0].stat().st_mtime_ns == mtime, "the module was rebuilt: csrc/ changed since make env"
    stamp = corebuild.CSRC.parent / f"_backend_{fam}.stamp"
    assert stamp.read_text().split()[0] == torch.__version__


def test_the_build_compiles_one_unit_straight_into_its_destination(tmp_path: Path) -> None:
    """One command compiles csrc/accl.cpp and links it into a temporary beside the module: no object file is kept or
    read anywhere (a shared /tmp's planted objects once went into the module every accl job loads)."""
    log = tmp_path / "argv"
    fake = tmp_path / "mpicxx"
    fake.write_text(f'#!/bin/sh\nfor a; do printf "%s\\n" "$a"; done >> {log}\n'
                    'while [ $# -gt 1 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    fake.chmod(0o755)
    dest = tmp_path / "dest"
    out = corebuild.build(str(VENV_BIN / "mpicc"), dest, mpicxx=str(fake))
    args = log.read_text().splitlines()
    assert out.parent == dest and out.exists()
    sources = [a for a in args if a.endswith((".cpp", ".o", ".a", ".so", ".tmp"))]
    assert sources[0] == str(corebuild.CSRC / "accl.cpp")
    assert all(Path(a).parent == dest for a in sources[1:]), sources


def test_the_stamp_knows_whether_the_flight_recorder_header_is_found(tmp_path: Path) -> None:
    """Installing nlohmann/json.hpp after a build changes the stamp (same sources, same flags), so the next
    ``make env`` builds the recorder."""
    cxx = str(VENV_BIN / "mpicxx")
    flags = ["-std=c++20", "-nostdinc", f"-isystem{tmp_path}"]  # only tmp_path is searched
    without = corebuild._stamp(cxx, flags)
    assert not corebuild._finds_json(cxx, flags)
    (tmp_path / "nlohmann").mkdir()
    (tmp_path / "nlohmann" / "json.hpp").write_text("// the header\n")
    assert corebuild._finds_json(cxx, flags) and corebuild._stamp(cxx, flags) != without


def test_loaded_backend_matches_mpi4py_library_and_torch() -> None:
    from mpi4py import MPI

    mod = core.load_backend()  # built by `make env`: a library or torch mismatch is this test's failure
    assert mod.__name__.endswith(f"_backend_{core.family()}")
    assert mod.torch_version == torch.__version__
    assert mod.library_version().splitlines()[0] == MPI.Get_library_version().splitlines()[0]
    assert {"ProcessGroupACCL", "AcclWork", "Engine"} <= set(dir(mod))


def test_backend_for_another_torch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = core.load_backend()
    monkeypatch.setattr(mod, "torch_version", "0.0.1")
    with pytest.raises(EngineUnavailableError, match=r"built for torch 0\.0\.1.*corebuild --mpicc"):
        core.load_backend.__wrapped__()


def test_missing_backend_says_how_to_build_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def no_backend(name: str, *args: object):  # noqa: ANN202
        if "._backend_" in name:
            raise ImportError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_backend)
    with pytest.raises(EngineUnavailableError, match=r"not built .*corebuild --mpicc"):
        core.load_backend.__wrapped__()


def test_accl_imports_before_its_build_and_creating_a_group_says_how_to_build(tmp_path: Path) -> None:
    """``make env`` imports the build helper (``torchhpc.accl.corebuild``) before the module exists: importing accl
    needs no build; creating a group then raises EngineUnavailableError naming the build command."""
    src = Path(core.__file__).resolve().parents[2]
    shutil.copytree(src / "torchhpc", tmp_path / "torchhpc", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    code = (
        "import torch.distributed as dist, torchhpc.accl as accl\n"
        "from torchhpc.accl.corebuild import family_of\n"
        "from torchhpc.runtime.errors import EngineUnavailableError\n"
        "try:\n"
        "    dist.init_process_group('accl', store=dist.HashStore(), rank=0, world_size=1)\n"
        "except EngineUnavailableError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=False)
    assert out.returncode == 0, out.stderr
    assert "REFUSED accl: the C++ backend for" in out.stdout and "corebuild --mpicc" in out.stdout, out.stdout
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr  # nor at exit
    bare = subprocess.run([sys.executable, "-c", "import torchhpc.accl.corebuild"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=False)
    assert bare.returncode == 0 and not bare.stderr.strip(), bare.stderr  # what `make env` does before the build
