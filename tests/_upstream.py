"""A local git repository standing in for PyTorch's remote: the real ``ProcessGroupMPI.cpp`` region, tagged."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = ROOT / "tests" / "data" / "pytorch" / "ProcessGroupMPI.cpp.head"
PG_MPI = "torch/csrc/distributed/c10d/ProcessGroupMPI.cpp"


def tagged_upstream(where: Path, tag: str) -> Path:
    """Create a git repository at ``where`` holding the upstream file at its real path, tagged ``tag``;
    the build scripts clone it through ``PYTORCH_GIT=file://...`` as they would clone github."""
    (where / PG_MPI).parent.mkdir(parents=True)
    shutil.copy(UPSTREAM, where / PG_MPI)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-c", "init.defaultBranch=main"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "upstream"], ["tag", tag]):
        subprocess.run([*git, *cmd], cwd=where, check=True, capture_output=True, timeout=30)
    return where
