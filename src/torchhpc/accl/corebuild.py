"""Build accl's compiled core (``_core.c``) for one MPI family, and its front (``_front.cpp``) for the
installed torch: ``python -m torchhpc.accl.corebuild``.

The module links the MPI library behind the given ``mpicc``; like mpi4py's per-family MPI modules it is
named for that family (``_core_openmpi``, ``_core_mpich``), so one installation can hold both and
:mod:`torchhpc.accl.core` loads the one matching the library mpi4py loaded.  ``make env`` runs this for
the environment's MPI and for the side prefix of the other wheel; the Spack recipe runs it after install.
The front reads torch's tensors and options in C++ (torch's own headers, shipped in its wheel); it links no
MPI, so one build serves both families, and it is named for nothing but records the torch version it was
built against (:func:`torchhpc.accl.core.load_front` refuses another; accl then runs its Python adapter
alone, as where the front was never built).
Re-running is cheap: an output newer than its source (and, for the front, built for this torch) is kept.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

__all__ = ["build", "build_front", "build_backend", "family_of", "default_mpicc", "SOURCE", "FRONT_SOURCE",
           "BACKEND_SOURCES"]

SOURCE = Path(__file__).resolve().parent / "_core.c"
FRONT_SOURCE = SOURCE.parent / "_front.cpp"
CSRC = SOURCE.parent / "csrc"
#: the C++ backend's translation units (csrc/accl.hpp declares them all)
BACKEND_SOURCES = ("wire.cpp", "reduction.cpp", "engine.cpp", "ProcessGroupACCL.cpp", "module.cpp")


def default_mpicc() -> str:
    """``$MPICC``, else the ``mpicc`` beside this interpreter (the venv's MPI wheel), else on PATH."""
    env = os.environ.get("MPICC")
    if env:
        return env
    beside = Path(sys.executable).parent / "mpicc"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpicc")
    if not found:
        raise SystemExit("accl core build: no mpicc found; pass --mpicc or set MPICC")
    return found


def family_of(mpicc: str) -> str:
    """``openmpi`` or ``mpich`` (MPICH and its derivatives: Cray MPICH, Intel MPI, MVAPICH), from the
    macros ``mpi.h`` defines."""
    out = subprocess.run([mpicc, "-dM", "-E", "-x", "c", "-"], input="#include <mpi.h>\n", text=True,
                         capture_output=True, check=False)
    if out.returncode:
        raise SystemExit(f"accl core build: {mpicc} cannot preprocess <mpi.h>:\n{out.stderr}")
    names = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("#define ")}
    if "OMPI_MAJOR_VERSION" in names:
        return "openmpi"
    if "MPICH_VERSION" in names or "MPICH_NAME" in names:
        return "mpich"
    raise SystemExit(f"accl core build: the MPI behind {mpicc} is neither Open MPI nor MPICH-derived")


def _compile(cmd: list[str], out: Path) -> None:
    """Run ``cmd`` (whose last two words are ``-o <tmp>``) writing a temporary beside ``out``, then move
    it over ``out`` atomically: ranks or builds racing never load half a file."""
    fd, tmp = tempfile.mkstemp(prefix=out.name, suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([*cmd, "-o", tmp], check=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(mpicc: str | None = None, dest: Path | None = None, force: bool = False) -> Path:
    """Compile the core with ``mpicc`` into ``dest`` (default: this package); the output's path."""
    mpicc = mpicc or default_mpicc()
    fam = family_of(mpicc)
    dest = Path(dest) if dest is not None else SOURCE.parent
    out = dest / f"_core_{fam}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not force and out.exists() and out.stat().st_mtime >= SOURCE.stat().st_mtime:
        return out
    dest.mkdir(parents=True, exist_ok=True)
    _compile([mpicc, "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", f"-DCORE_NAME=_core_{fam}",
              f"-I{sysconfig.get_paths()['include']}", str(SOURCE)], out)
    return out


def build_front(cxx: str | None = None, dest: Path | None = None, force: bool = False) -> Path:
    """Compile the front against the importable torch with ``cxx`` (default: ``$CXX``, else ``c++``) into
    ``dest`` (default: this package); the output's path.  Its stamp file names the torch it was built for."""
    import torch  # the headers, libraries and ABI flags of the torch this front will run in
    from torch.utils import cpp_extension

    cxx = cxx or os.environ.get("CXX") or "c++"
    dest = Path(dest) if dest is not None else SOURCE.parent
    out = dest / f"_front{sysconfig.get_config_var('EXT_SUFFIX')}"
    stamp = out.with_name("_front.torch")
    if (not force and out.exists() and out.stat().st_mtime >= FRONT_SOURCE.stat().st_mtime and stamp.exists()
            and stamp.read_text().strip() == torch.__version__):
        return out
    dest.mkdir(parents=True, exist_ok=True)
    lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    _compile([cxx, "-O2", "-fPIC", "-shared", "-std=c++20", "-Wall", "-Wextra", "-Werror",
              "-Wno-missing-field-initializers", "-Wno-unused-parameter",  # (torch's own headers)
              f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f'-DTORCH_BUILT_FOR="{torch.__version__}"',
              *(f"-isystem{p}" for p in cpp_extension.include_paths()),
              f"-I{sysconfig.get_paths()['include']}", str(FRONT_SOURCE),
              f"-L{lib}", "-ltorch_python", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"], out)
    stamp.write_text(torch.__version__ + "\n")
    return out


def default_mpicxx(mpicc: str | None = None) -> str:
    """The C++ wrapper beside ``mpicc`` (``mpicxx``, else ``mpic++``), else ``$MPICXX``."""
    env = os.environ.get("MPICXX")
    if mpicc is None and env:
        return env
    base = Path(mpicc or default_mpicc())
    for name in ("mpicxx", "mpic++"):
        if (base.parent / name).exists():
            return str(base.parent / name)
    raise SystemExit(f"accl backend build: no mpicxx beside {base}; set MPICXX")


def _stamp(cxx: str, flags: list[str]) -> str:
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in (*BACKEND_SOURCES, "accl.hpp"):
        h.update((CSRC / name).read_bytes())
    h.update(" ".join([cxx, *flags]).encode())
    return f"{torch.__version__} {h.hexdigest()}"


def build_backend(mpicc: str | None = None, dest: Path | None = None, force: bool = False,
                  objdir: Path | None = None, mpicxx: str | None = None) -> Path:
    """Compile the C++ backend (``csrc/``) for the MPI family behind ``mpicc`` (its C++ wrapper) against the
    importable torch, into ``_backend_<family>`` in ``dest`` (default: this package); the output's path.
    Object files are kept per family in ``objdir`` (default ``build/accl-backend/<family>`` of the checkout, else
    a temporary directory), so an edit recompiles only its translation unit; a stamp (torch version, sha256 of
    the sources and flags) keeps a module whose inputs did not change."""
    import torch
    from torch.utils import cpp_extension

    mpicxx = mpicxx or default_mpicxx(mpicc)
    fam = family_of(mpicc or default_mpicc())
    name = f"_backend_{fam}"
    dest = Path(dest) if dest is not None else SOURCE.parent
    out = dest / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O2", "-fPIC", "-std=c++20", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
             "-Wno-missing-field-initializers", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DACCL_MODULE={name}",
             f'-DTORCH_BUILT_FOR="{torch.__version__}"', *(f"-isystem{p}" for p in cpp_extension.include_paths()),
             f"-isystem{sysconfig.get_paths()['include']}"]
    stamp_file = dest / f"{name}.stamp"
    stamp = _stamp(mpicxx, flags)
    if not force and out.exists() and stamp_file.exists() and stamp_file.read_text().strip() == stamp:
        return out
    root = SOURCE.parents[3]
    objdir = Path(objdir) if objdir is not None else (
        root / "build" / "accl-backend" / fam if (root / "Makefile").exists()
        else Path(tempfile.gettempdir()) / "torchhpc-accl-backend" / fam)
    objdir.mkdir(parents=True, exist_ok=True)
    header = CSRC / "accl.hpp"
    objs = []
    for src in BACKEND_SOURCES:
        obj = objdir / (Path(src).stem + ".o")
        objs.append(obj)
        newest = max((CSRC / src).stat().st_mtime, header.stat().st_mtime)
        if force or not obj.exists() or obj.stat().st_mtime < newest:
            _compile([mpicxx, *flags, "-c", str(CSRC / src)], obj)
    dest.mkdir(parents=True, exist_ok=True)
    _compile([mpicxx, "-shared", *map(str, objs), f"-L{lib}", "-ltorch_python", "-ltorch_cpu", "-ltorch", "-lc10",
              f"-Wl,-rpath,{lib}"], out)
    stamp_file.write_text(stamp + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mpicc", help="MPI compiler wrapper (default: $MPICC, the venv's, or PATH's)")
    ap.add_argument("--dest", type=Path, help="output directory (default: the torchhpc.accl package)")
    ap.add_argument("--force", action="store_true", help="rebuild even when up to date")
    ap.add_argument("--front", choices=("yes", "no", "only"), default="yes",
                    help="also build the C++ front for the importable torch (default), skip it, or build only it")
    ap.add_argument("--cxx", help="C++ compiler for the front (default: $CXX, else c++)")
    ap.add_argument("--backend", choices=("yes", "no", "only"), default="no",
                    help="also build the C++ backend (csrc/, issue 24) for this MPI family, or only it")
    ap.add_argument("--mpicxx", help="the MPI's C++ wrapper for the backend (default: the one beside --mpicc)")
    args = ap.parse_args(argv)
    if args.backend != "no":
        print(build_backend(args.mpicc, args.dest, args.force, mpicxx=args.mpicxx))
    if args.backend == "only":
        return 0
    if args.front != "only":
        print(build(args.mpicc, args.dest, args.force))
    if args.front != "no":
        print(build_front(args.cxx, args.dest, args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
