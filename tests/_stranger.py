"""Two unprivileged users on one node, as on a shared cluster: the user torchhpc works for (VICTIM) and another
user (STRANGER), each a uid with no capabilities and no groups (``setpriv``).  Needs root to switch uid; tests
skip, saying so, elsewhere."""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VICTIM, STRANGER = 4242, 4343

needs_two_users = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to play two unprivileged users")


_OPENED: list[tuple[Path, int]] = []


def _reachable() -> None:
    """The second user must reach this checkout and its environment, which a runner may have cloned under a 0700
    folder: search permission (o+x, never read) is added to the folders above them that lack it, once, and taken
    back when the tests end."""
    if _OPENED or getattr(_reachable, "done", False):
        return
    _reachable.done = True  # type: ignore[attr-defined]
    for target in (ROOT, Path(sys.prefix), Path(sys.executable).resolve().parent):
        for folder in (target, *target.parents):
            mode = stat.S_IMODE(folder.stat().st_mode)
            if not mode & 0o001 and folder not in dict(_OPENED):
                os.chmod(folder, mode | 0o001)
                _OPENED.append((folder, mode))
    atexit.register(lambda: [os.chmod(folder, mode) for folder, mode in reversed(_OPENED)])


def run_as(uid: int, code: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run Python ``code`` as ``uid`` (same gid, no groups, no capabilities), torchhpc importable; HOME is a
    fresh directory of that user's, TMPDIR as ``env`` says (default: the same home)."""
    return _as(uid, [sys.executable, "-c", textwrap.dedent(code)], {"PYTHONPATH": str(ROOT / "src"), **(env or {})},
               timeout)


def shell_as(uid: int, script: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run a bash ``script`` as ``uid`` in the checkout, as that user would type it: a plain login's PATH and a
    fresh HOME, nothing of this process's environment."""
    return _as(uid, ["bash", "-c", f"cd {ROOT} && {script}"], {"PATH": "/usr/local/bin:/usr/bin:/bin"}, timeout)


def _as(uid: int, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    _reachable()
    home = Path(tempfile.mkdtemp(prefix=f"home-{uid}-"))
    os.chown(home, uid, uid)
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(home),
            "LANG": "C"}
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", *argv]
    try:
        return subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def shared_dir() -> Path:
    """A fresh world-writable sticky directory, like /tmp or a scratch area (removed when the tests end)."""
    d = Path(tempfile.mkdtemp(prefix="shared-"))
    d.chmod(0o1777)
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d
