"""POSIX shared-memory segments that cannot outlive their job. A segment is a file in ``/dev/shm`` named ``torchhpc-
cs.<uid>.<pid>.<starttime>.<token>`` after the user and process that created it. Once every local rank has mapped
it, the creator unlinks the name (:meth:`Segment.unlink`): the memory then lives exactly as long as some process
maps it, so neither a normal exit, Ctrl-C nor SIGKILL can leak it. The only window in which a name exists is job
set-up; a crash there leaves a named file whose owner is dead, and :func:`reap_dead_segments` (run whenever a
segment is created) removes those: the user's own only (uid in the name and as the file's owner), so that another
user's file, or another user's live job hidden by ``hidepid``, stops nothing. Owner liveness is checked by pid *and*
process start time, so a recycled pid does not protect a stale segment. Jobs that share ``/dev/shm`` but not a PID
namespace (some container set-ups) cannot see each other's owners: give them separate directories with
``TORCHHPC_SHM_DIR``.

Huge pages: every process advises its mapping of a segment of at least 2 MiB for transparent huge pages
(``MADV_HUGEPAGE``) and the creator fills it through that mapping (``MADV_POPULATE_WRITE``), so the shared memory
gets 2 MiB pages wherever the kernel gives them to advised shared memory: a tmpfs mounted ``huge=advise``
(``huge=always`` / ``within_size`` need no advice), or ``shmem_enabled`` ``advise`` or ``always``.  Elsewhere it
gets 4 KiB pages, as before (:func:`shared_page_setting` says which, ``torchhpc doctor`` shows it).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
from pathlib import Path

import torch

__all__ = ["PREFIX", "Segment", "SharedMemoryTooSmall", "shm_dir", "reap_dead_segments", "list_segments",
           "shared_page_setting"]

PREFIX = "torchhpc-cs"
HUGE = 2 << 20  # a PMD-sized transparent huge page
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.11's mmap lacks the name
_NAME_RE = re.compile(rf"^{re.escape(PREFIX)}\.(\d+)\.(\d+)\.(\d+)\.[0-9a-f]+$")  # uid, pid, start time


class SharedMemoryTooSmall(MemoryError):
    """Raised when the shared-memory file system cannot hold a requested segment."""


def shm_dir() -> Path:
    """Directory of POSIX shared memory: ``$TORCHHPC_SHM_DIR`` (odd systems, tests), else ``/dev/shm``."""
    return Path(os.environ.get("TORCHHPC_SHM_DIR", "/dev/shm"))


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces or parentheses: split after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _owner_alive(pid: int, start: int) -> bool:
    if not Path("/proc").is_dir():  # no procfs: fall back to pid existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    now = _start_time(pid)
    return now is not None and now == start


def list_segments(directory: Path | None = None) -> list[tuple[Path, int]]:
    """This user's named chunkstore segments in the shared-memory directory, with their owner pid."""
    d = directory or shm_dir()
    out = []
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return out
    uid = os.geteuid()
    for name in names:
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) == uid:
            out.append((d / name, int(m.group(2))))
    return out


def reap_dead_segments(directory: Path | None = None) -> list[Path]:
    """Unlink this user's segments left by processes that died during set-up; return what was removed.  Files
    of other users (whatever their name says) are never touched."""
    removed = []
    d = directory or shm_dir()
    uid = os.geteuid()
    for path, _pid in list_segments(d):
        m = _NAME_RE.match(path.name)
        assert m is not None
        try:
            if os.lstat(path).st_uid != uid or _owner_alive(int(m.group(2)), int(m.group(3))):
                continue  # a name that claims our uid on another's file; or a live owner
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass  # another of our jobs' reapers was faster
    return removed


def _mount_huge(d: Path) -> str | None:
    """The ``huge=`` option of the tmpfs mount holding ``d`` (None: not a tmpfs, or unreadable)."""
    best, option = "", None
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                _, where, kind, opts, *_ = line.split()
                inside = str(d) == where or str(d).startswith(where.rstrip("/") + "/")
                if kind == "tmpfs" and inside and len(where) >= len(best):
                    best = where
                    option = next((o.split("=", 1)[1] for o in opts.split(",") if o.startswith("huge=")), "never")
    except OSError:
        return None
    return option


def shared_page_setting(directory: Path | None = None) -> tuple[bool, str]:
    """Whether segments in ``directory`` (default :func:`shm_dir`) can get 2 MiB pages, and why, from the tmpfs
    mount's ``huge=`` option and the kernel's ``shmem_enabled`` (``deny`` and ``force`` override the mount)."""
    from ..runtime.hugepages import kernel_setting

    d = directory or shm_dir()
    mount, shmem = _mount_huge(d), kernel_setting("shmem_enabled")
    why = f"{d}: tmpfs huge={mount or '?'}, shmem_enabled {shmem or '?'}"
    if shmem in ("deny", "force"):
        return shmem == "force", why
    return mount in ("always", "within_size", "advise"), why


def _too_small_message(nbytes: int, free: int, d: Path) -> str:
    return (
        f"shared memory at {d} has {free / 2**30:.2f} GiB free but a chunkstore segment needs "
        f"{nbytes / 2**30:.2f} GiB. Raise the limit: `mount -o remount,size=<N>G {d}` (as root), "
        f"`docker run --shm-size=<N>g` / a Kubernetes memory-backed emptyDir in containers, "
        f"or place fewer rows in the host tier (larger capacity_per_device, or more nodes)."
    )


def _free(d: Path) -> int:
    vfs = os.statvfs(d)
    return vfs.f_bavail * vfs.f_frsize


class Segment:
    """One mapped shared-memory segment; ``tensor`` is a flat uint8 view of it."""

    def __init__(self, path: Path, nbytes: int, fd: int, owner: bool):
        self.path = path
        self.nbytes = nbytes
        self.owner = owner
        st = os.fstat(fd)
        self.inode = (st.st_dev, st.st_ino)
        # mmap refuses length 0; keep one page so empty tiers still have a valid mapping.
        self._mm = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        if nbytes >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
            self._mm.madvise(mmap.MADV_HUGEPAGE)  # before any fault: pages come huge where the tmpfs allows it
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]
        self._unlinked = False

    def huge_kib(self) -> int:
        """KiB of this process's mapping of the segment that 2 MiB pages back (0: 4 KiB pages)."""
        from ..runtime.hugepages import huge_kib

        return huge_kib(self.tensor.data_ptr(), self.nbytes, field="ShmemPmdMapped") if self.nbytes else 0

    def _reserve(self) -> None:
        """Allocate every page now, through the advised mapping so that they come huge where they can: a full
        tmpfs then fails here instead of killing a later write with SIGBUS."""
        full = (errno.ENOSPC, errno.ENOMEM, errno.EFAULT)  # populate reports a full tmpfs's SIGBUS as EFAULT
        try:
            self._mm.madvise(MADV_POPULATE_WRITE)
            return
        except OSError as e:
            if e.errno in full:
                raise self._too_small() from e
            if e.errno not in (errno.EINVAL, errno.ENOSYS):  # before Linux 5.14: fallocate below
                raise
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as e:
            if e.errno in full:
                raise self._too_small() from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        finally:
            os.close(fd)

    def _too_small(self) -> SharedMemoryTooSmall:
        d = self.path.parent
        return SharedMemoryTooSmall(_too_small_message(self.nbytes, _free(d), d))

    @classmethod
    def create(cls, nbytes: int, directory: Path | None = None) -> Segment:
        """Create and map a new segment of ``nbytes`` owned by this process (reaps dead segments first)."""
        if nbytes < 0:
            raise ValueError(f"segment size must be >= 0, got {nbytes}")
        d = directory or shm_dir()
        if not d.is_dir():
            raise FileNotFoundError(f"shared-memory directory {d} does not exist (set TORCHHPC_SHM_DIR)")
        reap_dead_segments(d)
        free = _free(d)
        if nbytes > free:
            raise SharedMemoryTooSmall(_too_small_message(nbytes, free, d))
        pid = os.getpid()
        name = f"{PREFIX}.{os.geteuid()}.{pid}.{_start_time(pid) or 0}.{secrets.token_hex(6)}"
        path = d / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            seg = cls(path, nbytes, fd, owner=True)  # (closes fd once mapped)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            path.unlink(missing_ok=True)
            raise
        try:
            if nbytes:
                seg._reserve()
        except BaseException:
            seg.close()
            raise
        return seg

    @classmethod
    def attach(cls, path: str | Path, nbytes: int) -> Segment:
        """Map an existing segment created by a local peer."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"shared segment {path} vanished before this rank mapped it; do all ranks of the node "
                f"see the same {path.parent}?") from e
        return cls(path, nbytes, fd, owner=False)

    def unlink(self) -> None:
        """Remove the name (owner only); the memory stays valid while any process maps it."""
        if self.owner and not self._unlinked:
            self.path.unlink(missing_ok=True)
            self._unlinked = True

    def close(self) -> None:
        """Unlink (owner) and unmap; views of the segment must have been dropped."""
        self.unlink()
        self.tensor = None  # type: ignore[assignment]
        # If a caller still holds a view, the mapping goes when that view is freed.
        with contextlib.suppress(BufferError):
            self._mm.close()

    def __repr__(self) -> str:
        return f"Segment({self.path.name}, {self.nbytes} B, owner={self.owner})"
