"""Paths only this user can reach, on nodes other users share.

``/tmp``, ``/dev/shm`` and scratch are world-writable: a fixed name there can be taken first by another user, who
then owns what we build, load or read.  Every place torchhpc writes outside a path the user named comes from here:
a directory created 0700 (or found already so) and owned by this user, refused otherwise with the reason, as git's
``safe.directory`` and Open MPI's per-user session directories do.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from .errors import TorchhpcError

__all__ = ["UnsafePathError", "private_dir", "runtime_dir", "cache_dir", "check_trusted"]


class UnsafePathError(TorchhpcError):
    """A path torchhpc would use is not this user's alone (another owner, a symlink, writable by others)."""


def _why_untrusted(st: os.stat_result, *, private: bool, owners: tuple[int, ...]) -> str | None:
    if st.st_uid not in owners:
        return f"owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"
    if stat.S_IMODE(st.st_mode) & (0o077 if private else 0o022):
        return f"mode {stat.S_IMODE(st.st_mode):04o} lets {'others reach' if private else 'others write'} it"
    return None


def check_trusted(path: str | os.PathLike[str], *, private: bool = False, owners: tuple[int, ...] = ()) -> Path:
    """``path`` itself (not followed if a symlink), owned by this user (or one of ``owners``) and writable by
    no one else (``private``: reachable by no one else); raises :class:`UnsafePathError` saying why not."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafePathError(f"{path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{path} is a symbolic link; torchhpc uses only the real path here")
    why = _why_untrusted(st, private=private, owners=(os.geteuid(), *owners))
    if why:
        raise UnsafePathError(f"{path} is {why}: another user could plant or read what torchhpc keeps there")
    return path


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a directory only this user can reach: created 0700 (parents too, each made 0700) or, if it
    exists, checked to be this user's, not a symlink and closed to others; :class:`UnsafePathError` otherwise."""
    path = Path(path)
    if not path.parent.exists():
        private_dir(path.parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return check_trusted(path, private=True)


def _private_chain(base: Path, parts: tuple[str, ...]) -> Path:
    """``base`` and each of ``parts`` below it as :func:`private_dir`: every level checked, not only the last."""
    out = private_dir(base)
    for part in parts:
        out = private_dir(out / part)
    return out


def runtime_dir(*parts: str) -> Path:
    """``$TMPDIR/torchhpc-<uid>/<parts>``: this user's scratch on this node (dumps, build objects)."""
    return _private_chain(Path(tempfile.gettempdir()) / f"torchhpc-{os.geteuid()}", parts)


def cache_dir(*parts: str) -> Path:
    """``$XDG_CACHE_HOME/torchhpc/<parts>`` (default ``~/.cache``): builds kept across jobs, as torch keeps its
    extensions in a per-user cache."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    base.mkdir(parents=True, exist_ok=True)
    return _private_chain(base / "torchhpc", parts)

