# Spack recipes import their directives with `from spack.package import *` (Spack's convention).
# ruff: noqa: F403, F405
# torchhpc's PyTorch recipe: Spack's builtin py-torch, plus the patches in patches/pytorch/vX.Y.Z/.
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


def _supported_patches():
    """(version, patch path relative to this package directory) for every row of the version table."""
    table = os.path.join(_TOP, "utils", "pytorch_versions.tsv")
    with open(table) as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip() and not line.startswith("#")]
    header, rows = rows[0], rows[1:]
    col = {name: i for i, name in enumerate(header)}
    out = []
    for row in rows:
        patch_dir = os.path.join(_TOP, "patches", "pytorch", row[col["patches"]])
        for name in sorted(os.listdir(patch_dir)):
            if name.endswith(".patch"):
                out.append((row[col["torch"]], os.path.relpath(os.path.join(patch_dir, name), _HERE)))
    return out


class PyTorch(BuiltinPyTorch):
    """Tensors and dynamic neural networks in Python with strong GPU acceleration, built with torchhpc's
    patches: ProcessGroupMPI accepts CUDA tensors on CUDA-aware MPICH derivatives (Cray MPICH), asking the
    MPI library (MPIX_Query_cuda_support / MPIX_GPU_query_support) or MPICH_GPU_SUPPORT_ENABLED=1."""

    # Patches are applied in file-name order, like utils/build_pytorch.sh does.
    for _version, _patch in _supported_patches():
        patch(_patch, when=f"@{_version}")
    del _version, _patch

    # torchhpc runs on torch.distributed with the MPI backend; a build without it is not ours.
    conflicts("~distributed", msg="torchhpc needs torch.distributed (+distributed)")
    conflicts("~mpi", when="+distributed", msg="torchhpc's patches are for the MPI backend (+mpi)")
