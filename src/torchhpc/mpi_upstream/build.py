"""Build PyTorch's own MPI backend (upstream's ``ProcessGroupMPI.cpp`` with our patches) for the installed torch,
one module per MPI family: ``python -m torchhpc.mpi_upstream.build`` (``make mpi-backend``).

Source, in this order: ``MPI_BACKEND_SOURCE=<file>``; else the pinned copy (``third_party/pytorch``, its
PROVENANCE.tsv names repo, commit, sha256 and the torch release it serves) when that release is the installed
torch's; else the file at the installed release's tag, downloaded from GitHub (not with
``MPI_BACKEND_NO_DOWNLOAD=1``).  The patches are those ``utils/pytorch_versions.tsv`` lists for that release
(``patches/pytorch/<dir>/*.patch`` in file-name order, applied with ``git apply --check`` then ``git apply``, as
``utils/build_pytorch.sh`` does; ``MPI_BACKEND_PATCHES=<dir>`` overrides).  The patched file and a small glue
file (``_module.cpp``) are compiled as one extension with the MPI's C++ wrapper against torch's headers and
libraries, into ``_pg_mpi_<family>`` beside this module; a stamp keeps a build whose inputs did not change.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from torchhpc.mpi_upstream import module_name
from torchhpc.runtime import private

__all__ = ["BuildError", "Source", "build", "select_source", "patches_for", "apply_patches", "family_of",
           "default_mpicxx", "default_workdir", "side_mpicxx", "torch_release", "PG_MPI", "TAG_URL"]

PKG = Path(__file__).resolve().parent
ROOT = PKG.parents[2]  # the checkout (src/torchhpc/mpi_upstream/build.py)
GLUE = PKG / "_module.cpp"
VENDOR = ROOT / "third_party" / "pytorch"
PG_MPI = "torch/csrc/distributed/c10d/ProcessGroupMPI.cpp"
TAG_URL = "https://raw.githubusercontent.com/pytorch/pytorch/v{release}/" + PG_MPI


class BuildError(RuntimeError):
    """The backend cannot be built as asked; the message says what is missing and how to supply it."""


@dataclass(frozen=True)
class Source:
    """Upstream's ProcessGroupMPI.cpp for this build and where it came from."""

    path: Path
    origin: str


def torch_release(version: str | None = None) -> str:
    """The release of ``version`` (default: the installed torch) without local tags: ``2.13.0+cpu`` -> ``2.13.0``."""
    if version is None:
        import torch

        version = torch.__version__
    return version.split("+")[0]


def _tsv(path: Path) -> list[dict[str, str]]:
    lines = [x.split("\t") for x in path.read_text().splitlines() if x.strip() and not x.startswith("#")]
    return [dict(zip(lines[0], row, strict=True)) for row in lines[1:]]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _release_row(release: str) -> dict[str, str] | None:
    table = ROOT / "utils" / "pytorch_versions.tsv"
    if not table.exists():
        return None
    return next((row for row in _tsv(table) if row["torch"] == release), None)


def pinned_copy() -> dict[str, str]:
    """The PROVENANCE.tsv row of the vendored ProcessGroupMPI.cpp."""
    return next(r for r in _tsv(VENDOR / "PROVENANCE.tsv") if r["file"] == "ProcessGroupMPI.cpp")


def _download(url: str, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.name, suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as resp:  # noqa: S310 (https)
            shutil.copyfileobj(resp, out)
        os.replace(tmp, dest)
    except OSError as exc:
        raise BuildError(f"mpi-backend: could not download {url} ({exc}); set MPI_BACKEND_SOURCE=<a copy of "
                         "that file>") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def select_source(release: str, workdir: Path, explicit: Path | None = None,
                  allow_download: bool | None = None) -> Source:
    """Upstream's file for torch ``release``: ``explicit`` (or ``$MPI_BACKEND_SOURCE``), the pinned copy when
    it serves ``release``, else the tag's file from GitHub (unless downloads are off)."""
    given = explicit or (Path(os.environ["MPI_BACKEND_SOURCE"]) if os.environ.get("MPI_BACKEND_SOURCE") else None)
    if given is not None:
        if not given.is_file():
            raise BuildError(f"mpi-backend: MPI_BACKEND_SOURCE={given} is not a file")
        return Source(given.resolve(), f"MPI_BACKEND_SOURCE={given}")
    if (VENDOR / "PROVENANCE.tsv").exists():
        row = pinned_copy()
        if row["torch"] == release:
            path = VENDOR / row["file"]
            if _sha256(path) != row["sha256"]:
                raise BuildError(f"mpi-backend: {path} differs from its sha256 in {VENDOR / 'PROVENANCE.tsv'}")
            return Source(path, f"pinned copy of {row['repo'].split()[0]}@{row['commit'][:12]} (torch {release})")
    if allow_download is None:
        allow_download = os.environ.get("MPI_BACKEND_NO_DOWNLOAD", "") not in ("1", "yes", "true")
    url = TAG_URL.format(release=release)
    if not allow_download:
        raise BuildError(f"mpi-backend: no pinned ProcessGroupMPI.cpp for torch {release} and downloads are off "
                         f"(MPI_BACKEND_NO_DOWNLOAD); set MPI_BACKEND_SOURCE=<{url}>")
    dest = workdir / f"v{release}" / "ProcessGroupMPI.upstream.cpp"
    if not dest.exists():
        _download(url, dest)
    return Source(dest, f"downloaded from {url}")


def patches_for(release: str) -> list[Path]:
    """The patches for torch ``release`` in application order (``$MPI_BACKEND_PATCHES`` overrides the table)."""
    forced = os.environ.get("MPI_BACKEND_PATCHES")
    if forced:
        folder = Path(forced)
    else:
        row = _release_row(release)
        if row is None:
            raise BuildError(f"mpi-backend: torch {release} is not in {ROOT / 'utils' / 'pytorch_versions.tsv'} "
                             "(or this is not a torchhpc checkout): set MPI_BACKEND_PATCHES=<directory of *.patch>")
        folder = ROOT / "patches" / "pytorch" / row["patches"]
    found = sorted(folder.glob("*.patch"))
    if not found:
        raise BuildError(f"mpi-backend: no *.patch files in {folder}")
    return found


def apply_patches(source: Path, patches: list[Path], out: Path) -> Path:
    """``source`` with ``patches`` applied as ``utils/build_pytorch.sh`` applies them (``git apply --check``, then
    ``git apply``; ``patch -p1 --fuzz=0`` where git is missing), written to ``out``."""
    with tempfile.TemporaryDirectory(prefix="mpi-backend-") as tmp:
        target = Path(tmp) / PG_MPI
        target.parent.mkdir(parents=True)
        shutil.copyfile(source, target)
        for patch in patches:
            if shutil.which("git"):
                steps = [["git", "apply", "--check", "--verbose", "--unsafe-paths", str(patch)],
                         ["git", "apply", "--unsafe-paths", str(patch)]]
            else:
                steps = [["patch", "-p1", "--fuzz=0", "--forward", "--dry-run", "-i", str(patch)],
                         ["patch", "-p1", "--fuzz=0", "--forward", "-i", str(patch)]]
            for cmd in steps:
                proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, check=False)
                if proc.returncode:
                    raise BuildError(f"mpi-backend: {patch.name} does not apply to {source} "
                                     f"({' '.join(cmd[:2])}):\n{proc.stdout}{proc.stderr}")
        _write_atomic(out, target.read_bytes())
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def default_mpicxx() -> str:
    """``$MPICXX``, else the ``mpicxx`` beside this interpreter (the venv's MPI wheel), else on PATH."""
    if os.environ.get("MPICXX"):
        return os.environ["MPICXX"]
    beside = Path(sys.executable).parent / "mpicxx"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpicxx") or shutil.which("mpic++")
    if not found:
        raise BuildError("mpi-backend: no mpicxx found; pass --mpicxx (Cray: CC) or set MPICXX")
    return found


def side_mpicxx() -> str | None:
    """The ``mpicxx`` of the MPICH that ``make env`` puts beside an Open MPI venv, if there."""
    from torchhpc.runtime.mpirun import side_mpich

    root = side_mpich()
    return str(root / "bin" / "mpicxx") if root is not None and (root / "bin" / "mpicxx").exists() else None


def family_of(mpicxx: str) -> str:
    """``openmpi`` or ``mpich`` (and its derivatives), read from ``mpi.h`` by accl's core build."""
    from torchhpc.accl.corebuild import family_of as core_family_of

    try:
        return core_family_of(mpicxx)
    except SystemExit as exc:  # the core build is a command line: it stops with its message
        raise BuildError(f"mpi-backend: {exc}") from None


def default_workdir(root: Path = ROOT) -> Path:
    """Where downloads and the build tree go: ``build/mpi-backend`` of the checkout at ``root``, else this user's
    0700 ``~/.cache/torchhpc/mpi-backend`` (never a fixed name in a shared ``/tmp``: a file there is compiled)."""
    if (root / "patches" / "pytorch").is_dir():
        return root / "build" / "mpi-backend"
    return private.cache_dir("mpi-backend")  # this user's alone: a download kept there is compiled


def build(mpicxx: str | None = None, dest: Path | None = None, workdir: Path | None = None,
          source: Path | None = None, force: bool = False, allow_download: bool | None = None,
          log=print) -> Path:
    """Build the backend with ``mpicxx`` into ``dest`` (default: this package); the module's path.
    Kept when its stamp (torch, source, patches, glue, wrapper) says nothing changed, unless ``force``."""
    import torch
    from torch.utils import cpp_extension

    mpicxx = mpicxx or default_mpicxx()
    fam = family_of(mpicxx)
    name = module_name(fam)
    dest = Path(dest) if dest is not None else PKG
    workdir = Path(workdir) if workdir is not None else default_workdir()
    release = torch_release()
    src = select_source(release, workdir, source, allow_download)
    patches = patches_for(release)
    out = dest / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    stamp_file = dest / f"{name}.stamp"
    stamp = {"torch": torch.__version__, "source": _sha256(src.path), "origin": src.origin,
             "patches": {p.name: _sha256(p) for p in patches}, "glue": _sha256(GLUE), "mpicxx": mpicxx}
    if not force and out.exists() and stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return out
    patched = apply_patches(src.path, patches, workdir / f"v{release}" / "ProcessGroupMPI.patched.cpp")
    row = _release_row(release)
    std = "c++20" if row is None or row["cxx"] == "C++20" else "c++17"
    lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [mpicxx, "-O2", "-fPIC", "-shared", f"-std={std}", "-Wall", "-Wextra", "-Wno-unused-parameter",
           "-Wno-deprecated-declarations",  # upstream calls Tensor::type() (alltoall_base)
           "-DUSE_C10D_MPI", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DMPI_UPSTREAM_MODULE={name}",
           f'-DMPI_UPSTREAM_SOURCE="{patched}"', f'-DMPI_UPSTREAM_TORCH="{torch.__version__}"',
           *(f"-isystem{p}" for p in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}",
           str(GLUE), f"-L{lib}", "-ltorch_python", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    log(f"mpi-backend: {fam} with {mpicxx}: {src.origin}, patches {', '.join(p.name for p in patches)}")
    dest.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name, suffix=".tmp", dir=dest)
    os.close(fd)
    try:
        proc = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True, check=False)
        if proc.returncode:
            raise BuildError(f"mpi-backend: compiling {patched} for {fam} failed:\n{' '.join(cmd)}\n"
                             f"{proc.stdout}{proc.stderr}")
        if proc.stderr.strip():
            log(proc.stderr.rstrip())
        from torchhpc.accl.corebuild import readable_by_all  # (as family_of: accl's package loads mpi4py)

        readable_by_all(tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    stamp_file.write_text(json.dumps(stamp, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mpicxx", action="append",
                    help="MPI C++ wrapper to build for (repeatable; default: $MPICXX or the venv's, plus the side "
                         "MPICH's with --all)")
    ap.add_argument("--all", action="store_true", help="also build for the MPICH that `make env` puts in $VENV/mpich")
    ap.add_argument("--source", type=Path, help="upstream ProcessGroupMPI.cpp to use (or $MPI_BACKEND_SOURCE)")
    ap.add_argument("--dest", type=Path, help="output directory (default: the torchhpc.mpi_upstream package)")
    ap.add_argument("--workdir", type=Path, help="where the patched source goes (default: build/mpi-backend)")
    ap.add_argument("--force", action="store_true", help="rebuild even when the stamp says it is up to date")
    args = ap.parse_args(argv)
    wrappers = list(args.mpicxx or [default_mpicxx()])
    if args.all and (side := side_mpicxx()) is not None and side not in wrappers:
        wrappers.append(side)
    try:
        for mpicxx in wrappers:
            print(build(mpicxx, args.dest, args.workdir, args.source, args.force))
    except BuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
