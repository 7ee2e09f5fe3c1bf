"""Build accl's compiled core (``_core.c``) for one MPI family: ``python -m torchhpc.accl.corebuild``.

The module links the MPI library behind the given ``mpicc``; like mpi4py's per-family MPI modules it is
named for that family (``_core_openmpi``, ``_core_mpich``), so one installation can hold both and
:mod:`torchhpc.accl.core` loads the one matching the library mpi4py loaded.  ``make env`` runs this for
the environment's MPI and for the side prefix of the other wheel; the Spack recipe runs it after install.
Re-running is cheap: an output newer than the source is kept.
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

__all__ = ["build", "family_of", "default_mpicc", "SOURCE"]

SOURCE = Path(__file__).resolve().parent / "_core.c"


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


def build(mpicc: str | None = None, dest: Path | None = None, force: bool = False) -> Path:
    """Compile the core with ``mpicc`` into ``dest`` (default: this package); the output's path."""
    mpicc = mpicc or default_mpicc()
    fam = family_of(mpicc)
    dest = Path(dest) if dest is not None else SOURCE.parent
    out = dest / f"_core_{fam}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not force and out.exists() and out.stat().st_mtime >= SOURCE.stat().st_mtime:
        return out
    dest.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name, suffix=".tmp", dir=dest)
    os.close(fd)
    cmd = [mpicc, "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", f"-DCORE_NAME=_core_{fam}",
           f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", tmp]
    try:
        subprocess.run(cmd, check=True)
        os.replace(tmp, out)  # atomic: ranks or builds racing never load half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mpicc", help="MPI compiler wrapper (default: $MPICC, the venv's, or PATH's)")
    ap.add_argument("--dest", type=Path, help="output directory (default: the torchhpc.accl package)")
    ap.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = ap.parse_args(argv)
    print(build(args.mpicc, args.dest, args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
