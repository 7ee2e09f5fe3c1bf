# Spack recipes import their directives with `from spack.package import *` (Spack's convention).
# ruff: noqa: F403, F405
# torchhpc's PyTorch recipe: Spack's builtin py-torch, plus the patches in patches/pytorch/<patches column>/.
#
# The supported versions and their patch directories are read from utils/pytorch_versions.tsv, the same
# table the Makefile route uses, so both routes always apply the same patches to the same releases.
import os

from spack.package import *

try:  # Spack >= 1.0: the builtin repository is the spack_repo.builtin package
    from spack_repo.builtin.packages.py_torch.package import PyTorch as BuiltinPyTorch
except ImportError:  # Spack <= 0.23
    from spack.pkg.builtin.py_torch import PyTorch as BuiltinPyTorch

_HERE = os.path.dirname(os.path.abspath(__file__))
_TOP = os.path.normpath(os.path.join(_HERE, "..", ".."))


def _table():
    """The rows of utils/pytorch_versions.tsv as dicts (column name -> value)."""
    with open(os.path.join(_TOP, "utils", "pytorch_versions.tsv")) as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip() and not line.startswith("#")]
    return [dict(zip(rows[0], row, strict=True)) for row in rows[1:]]


def _supported_patches():
    """(version, patch path relative to this package directory) for every row of the version table."""
    out = []
    for row in _table():
        patch_dir = os.path.join(_TOP, "patches", "pytorch", row["patches"])
        for name in sorted(os.listdir(patch_dir)):
            if name.endswith(".patch"):
                out.append((row["torch"], os.path.relpath(os.path.join(patch_dir, name), _HERE)))
    return out


def _missing_versions(known):
    """(version, tag commit) of table rows the builtin recipe does not declare (2.13.0 at the pinned commit)."""
    return [(row["torch"], row["commit"]) for row in _table() if row["torch"] not in known]


class PyTorch(BuiltinPyTorch):
    """Tensors and dynamic neural networks in Python with strong GPU acceleration, built with torchhpc's
    patches: ProcessGroupMPI accepts CUDA tensors on CUDA-aware MPICH derivatives (Cray MPICH), asking the
    MPI library (MPIX_Query_cuda_support / MPIX_GPU_query_support) or MPICH_GPU_SUPPORT_ENABLED=1."""

    # Releases of the table that the builtin recipe lacks, at the tag commit the table names.
    for _version, _commit in _missing_versions({str(v) for v in getattr(BuiltinPyTorch, "versions", {})}):
        version(_version, tag=f"v{_version}", commit=_commit, submodules=True)
    _version = _commit = None
    del _version, _commit

    # Patches are applied in file-name order, like utils/build_pytorch.sh does.
    for _version, _patch in _supported_patches():
        patch(_patch, when=f"@{_version}")
    del _version, _patch

    # torchhpc runs on torch.distributed with the MPI backend; a build without it is not ours.
    conflicts("~distributed", msg="torchhpc needs torch.distributed (+distributed)")
    conflicts("~mpi", when="+distributed", msg="torchhpc's patches are for the MPI backend (+mpi)")
