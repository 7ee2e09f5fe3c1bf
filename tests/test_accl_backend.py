"""accl's C++ backend (``csrc/``, issue 24): built per MPI family against the installed torch with
-Wall -Wextra -Werror, kept when its stamp says nothing changed, loaded for the library mpi4py loaded and
refused when built for another torch or library."""

from __future__ import annotations

import importlib
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

    try:
        mod = core.load_backend()
    except EngineUnavailableError as exc:
        pytest.skip(str(exc))
    assert mod.__name__.endswith(f"_backend_{core.family()}")
    assert mod.torch_version == torch.__version__
    assert mod.library_version().splitlines()[0] == MPI.Get_library_version().splitlines()[0]
    assert {"ProcessGroupACCL", "AcclWork", "Engine"} <= set(dir(mod))
    # the same answer as the Python side's query (mpi4py), e.g. False for both PyPI wheels
    from torchhpc.accl import mpi_cuda_aware

    assert mod.cuda_aware() == mpi_cuda_aware()


def test_backend_for_another_torch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        mod = core.load_backend()
    except EngineUnavailableError as exc:
        pytest.skip(str(exc))
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
