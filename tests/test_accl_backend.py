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
from torchhpc.errors import EngineUnavailableError

VENV_BIN = Path(sys.executable).parent


@pytest.mark.parametrize("mpicc", [VENV_BIN / "mpicc", VENV_BIN.parent / "mpich" / "bin" / "mpicc"])
def test_backend_builds_warning_free_per_family(tmp_path: Path, mpicc: Path) -> None:
    """Each MPI wheel's C++ wrapper builds a module named for its family (objects shared with ``make env``'s
    build, so only an edited translation unit is recompiled); a second build with nothing changed is kept."""
    if not mpicc.exists():
        pytest.skip(f"no {mpicc} (make env installs both MPI wheels)")
    fam = corebuild.family_of(str(mpicc))
    out = corebuild.build(str(mpicc), tmp_path)
    assert out.parent == tmp_path and out.name.startswith(f"_backend_{fam}.") and out.stat().st_size > 0
    stamp = tmp_path / f"_backend_{fam}.stamp"
    assert stamp.read_text().split()[0] == torch.__version__
    again = corebuild.build(str(mpicc), tmp_path)
    assert again == out and again.stat().st_mtime == out.stat().st_mtime


def test_loaded_backend_matches_mpi4py_library_and_torch() -> None:
    from mpi4py import MPI

    mod = core.load_backend()  # built by `make env`: a library or torch mismatch is this test's failure
    assert mod.__name__.endswith(f"_backend_{core.family()}")
    assert mod.torch_version == torch.__version__
    assert mod.library_version().splitlines()[0] == MPI.Get_library_version().splitlines()[0]
    assert {"ProcessGroupACCL", "AcclWork", "Engine"} <= set(dir(mod))
    # the same answer as the Python side's query (mpi4py), e.g. False for both PyPI wheels
    from torchhpc.accl import mpi_cuda_aware

    assert mod.cuda_aware() == mpi_cuda_aware()


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
        "from torchhpc.errors import EngineUnavailableError\n"
        "try:\n"
        "    dist.init_process_group('accl', store=dist.HashStore(), rank=0, world_size=1)\n"
        "except EngineUnavailableError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=False)
    assert out.returncode == 0, out.stderr
    assert "REFUSED accl: the C++ backend for" in out.stdout and "corebuild --mpicc" in out.stdout, out.stdout
