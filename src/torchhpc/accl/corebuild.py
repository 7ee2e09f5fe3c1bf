"""Build accl's C++ backend (``csrc/``) for one MPI family against the installed torch:
``python -m torchhpc.accl.corebuild [--mpicc PATH] [--mpicxx PATH]``.

The module links the MPI library behind the given wrapper; like mpi4py's per-family MPI modules it is named for
that family (``_backend_openmpi``, ``_backend_mpich``), so one installation can hold both and
:func:`torchhpc.accl.core.load_backend` loads the one matching the library mpi4py loaded.  ``make env`` runs
this for the environment's MPI and for the side prefix of the other wheel; the Spack recipe runs it after
install.  The backend is one translation unit (``csrc/accl.cpp`` includes the rest: torch's headers are parsed
once), compiled and linked in one command straight into a temporary beside the module, so no object file is
kept anywhere.  Re-running is cheap: a stamp (torch version, sha256 of the sources and flags, whether torch's
flight recorder can be built) keeps an unchanged module.
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

__all__ = ["build", "readable_by_all", "family_of", "default_mpicc", "default_mpicxx", "CSRC"]

CSRC = Path(__file__).resolve().parent / "csrc"
#: the backend's one translation unit (it includes every other file of csrc/)
UNIT = CSRC / "accl.cpp"
#: a test build's hooks (the wire protocol shown to Python, a garbled message on purpose): in the repository's tests
HOOKS = CSRC.parents[3] / "tests" / "accl_hooks.cpp"


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
        raise SystemExit("accl backend build: no mpicc found; pass --mpicc or set MPICC")
    return found


def family_of(mpicc: str) -> str:
    """``openmpi`` or ``mpich`` (MPICH and its derivatives: Cray MPICH, Intel MPI, MVAPICH), from the
    macros ``mpi.h`` defines."""
    out = subprocess.run([mpicc, "-dM", "-E", "-x", "c", "-"], input="#include <mpi.h>\n", text=True,
                         capture_output=True, check=False)
    if out.returncode:
        raise SystemExit(f"accl backend build: {mpicc} cannot preprocess <mpi.h>:\n{out.stderr}")
    names = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("#define ")}
    if "OMPI_MAJOR_VERSION" in names:
        return "openmpi"
    if "MPICH_VERSION" in names or "MPICH_NAME" in names:
        return "mpich"
    raise SystemExit(f"accl backend build: the MPI behind {mpicc} is neither Open MPI nor MPICH-derived")


def _compile(cmd: list[str], out: Path) -> None:
    """Run ``cmd`` (whose last two words are ``-o <tmp>``) writing a temporary beside ``out``, then move
    it over ``out`` atomically: ranks or builds racing never load half a file."""
    fd, tmp = tempfile.mkstemp(prefix=out.name, suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([*cmd, "-o", tmp], check=True)
        readable_by_all(tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def readable_by_all(path: str | os.PathLike[str]) -> None:
    """A built module's mode as the umask allows (0755 under 022): mkstemp's 0600, which the linker keeps, would
    hide a shared install's module from every user but its builder."""
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(path, 0o755 & ~mask)


def default_mpicxx(mpicc: str | None = None) -> str:
    """The C++ wrapper beside ``mpicc`` (``mpicxx``, else ``mpic++``; Cray's ``CC`` beside ``cc``), else
    ``$MPICXX``."""
    env = os.environ.get("MPICXX")
    if mpicc is None and env:
        return env
    base = Path(mpicc or default_mpicc())
    names = ("CC",) if base.name == "cc" else ("mpicxx", "mpic++")  # Cray's compiler wrappers: cc and CC
    for name in names:
        if (base.parent / name).exists():
            return str(base.parent / name)
    raise SystemExit(f"accl backend build: no mpicxx beside {base}; set MPICXX")


def _stamp(cxx: str, flags: list[str], hooks: bool = False) -> str:
    """What the module was built from: torch's version, then a digest of every source (with ``hooks``, a test
    build's :data:`HOOKS` too), the command's flags and whether the compiler finds nlohmann/json.hpp (the flight
    recorder is built exactly when it does: installing the header after a build changes the stamp, so the next
    ``make env`` builds the recorder)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    sources = [p for p in sorted(CSRC.iterdir()) if p.suffix in (".cpp", ".hpp")] + ([HOOKS] if hooks else [])
    for path in sources:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(" ".join([cxx, *flags]).encode())
    h.update(b"recorder" if _finds_json(cxx, flags) else b"no recorder")
    return f"{torch.__version__} {h.hexdigest()}"


def _backoff_flags() -> list[str]:
    """torchhpc.runtime.waiting.Backoff's numbers as the C++ waits' -DACCL_BACKOFF_* (one policy, defined there)."""
    from ..runtime.waiting import Backoff

    us = {"YIELD_US": Backoff.YIELD_S, "NAP_US": Backoff.SLEEP_S, "CAP_US": Backoff.CAP_S}
    return [f"-DACCL_BACKOFF_POLLS={Backoff.SPINS}", *(f"-DACCL_BACKOFF_{k}={round(v * 1e6)}" for k, v in us.items())]


def _finds_json(cxx: str, flags: list[str]) -> bool:
    """Whether ``cxx`` with ``flags`` finds ``<nlohmann/json.hpp>`` (what ``csrc/flight.cpp`` tests)."""
    probe = "#if __has_include(<nlohmann/json.hpp>)\nTORCHHPC_FOUND\n#endif\n"
    out = subprocess.run([cxx, *flags, "-E", "-x", "c++", "-"], input=probe, text=True, capture_output=True,
                         check=False)
    return out.returncode == 0 and "TORCHHPC_FOUND" in out.stdout


def build(mpicc: str | None = None, dest: Path | None = None, force: bool = False,
          mpicxx: str | None = None, test_hooks: bool = False) -> Path:
    """Compile the C++ backend (``csrc/``) for the MPI family behind ``mpicc`` (its C++ wrapper) against the
    importable torch, into ``_backend_<family>`` in ``dest`` (default: this package); the output's path.  A
    stamp (:func:`_stamp`) keeps a module whose inputs did not change.  ``test_hooks``: a test build (``make env``'s),
    which also shows the wire protocol's tables and texts to Python and can garble a message on purpose."""
    import torch
    from torch.utils import cpp_extension

    mpicxx = mpicxx or default_mpicxx(mpicc)
    mpicxx = os.path.abspath(shutil.which(mpicxx) or mpicxx)  # one stamp however the path was spelled
    if test_hooks and not HOOKS.is_file():
        raise FileNotFoundError(f"accl: a test build needs the repository's {HOOKS} (an installed package has none)")
    fam = family_of(mpicc or default_mpicc())
    name = f"_backend_{fam}"
    dest = Path(dest) if dest is not None else CSRC.parent
    out = dest / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [*_backoff_flags(), "-O2", "-fPIC", "-std=c++20", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
             "-DFMT_HEADER_ONLY", "-Wno-missing-field-initializers", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-DACCL_MODULE={name}", *([f'-DACCL_TEST_HOOKS="{HOOKS}"'] if test_hooks else []),
             f'-DTORCH_BUILT_FOR="{torch.__version__}"', *(f"-isystem{p}" for p in cpp_extension.include_paths()),
             f"-isystem{sysconfig.get_paths()['include']}",
             # nlohmann/json.hpp (torch's flight-recorder header needs it) from a Spack view or conda prefix
             *(f"-isystem{d}" for d in {Path(sys.prefix) / "include", Path(sys.base_prefix) / "include"}
               if (d / "nlohmann" / "json.hpp").exists())]
    stamp_file = dest / f"{name}.stamp"
    stamp = _stamp(mpicxx, flags, test_hooks)
    if not force and out.exists() and stamp_file.exists() and stamp_file.read_text().strip() == stamp:
        return out
    dest.mkdir(parents=True, exist_ok=True)
    _compile([mpicxx, *flags, "-shared", str(UNIT), f"-L{lib}", "-ltorch_python", "-ltorch_cpu", "-ltorch", "-lc10",
              f"-Wl,-rpath,{lib}"], out)
    stamp_file.write_text(stamp + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mpicc", help="MPI C wrapper naming the family (default: $MPICC, the venv's, or PATH's)")
    ap.add_argument("--mpicxx", help="the MPI's C++ wrapper (default: the one beside --mpicc)")
    ap.add_argument("--dest", type=Path, help="output directory (default: the torchhpc.accl package)")
    ap.add_argument("--force", action="store_true", help="rebuild even when up to date")
    ap.add_argument("--test-hooks", action="store_true", help="a test build, as make env's (the test suite needs it)")
    args = ap.parse_args(argv)
    print(build(args.mpicc, args.dest, args.force, mpicxx=args.mpicxx, test_hooks=args.test_hooks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
