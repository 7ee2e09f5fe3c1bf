# Spack recipes import their directives with `from spack.package import *` (Spack's convention).
# ruff: noqa: F403, F405
# torchhpc's mochi-margo: Spack's builtin recipe plus the release utils/native_versions.tsv pins when the builtin
# repository at the pinned commit (utils/spack_pins.tsv) does not have it yet (0.24.0: builtin stops at 0.23.1).
import os

from spack.package import *

try:  # Spack >= 1.0: the builtin repository is the spack_repo.builtin package
    from spack_repo.builtin.packages.mochi_margo.package import MochiMargo as BuiltinMochiMargo
except ImportError:  # Spack <= 0.23
    from spack.pkg.builtin.mochi_margo import MochiMargo as BuiltinMochiMargo

_TOP = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def _native_pin(name):
    """(version, tag, commit) of `name` in utils/native_versions.tsv."""
    with open(os.path.join(_TOP, "utils", "native_versions.tsv")) as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            if not line.startswith("#") and cols[0] == name:
                return cols[1], cols[4], cols[5]
    raise ValueError(f"{name} is not in utils/native_versions.tsv")


class MochiMargo(BuiltinMochiMargo):
    """Argobots bindings for the Mercury RPC library, at the release torchhpc pins."""

    git = "https://github.com/mochi-hpc/mochi-margo.git"

    _pin = _native_pin("margo")
    if _pin[0] not in {str(v) for v in getattr(BuiltinMochiMargo, "versions", {})}:
        version(_pin[0], tag=_pin[1], commit=_pin[2])
    del _pin
