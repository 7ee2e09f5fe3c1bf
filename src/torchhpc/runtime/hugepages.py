"""Transparent huge pages for torch's CPU tensors: what is in force, and torchhpc's default.

PyTorch's CPU allocator (``c10/core/impl/alloc_cpu.cpp``) asks the kernel for transparent huge pages
(``madvise(MADV_HUGEPAGE)``, page-aligned ``posix_memalign``) for every allocation of at least 2 MiB
(``gAlloc_threshold_thp``, ``c10/core/alignment.h``), but only when ``THP_MEM_ALLOC_ENABLE=1``.  It reads the
variable once, in a function-local static, at the process's first CPU tensor allocation of any size: setting
it later in the same process does nothing.  numpy madvises every array of at least 4 MiB unasked.

``import torchhpc`` sets ``THP_MEM_ALLOC_ENABLE=1`` when it is unset and the kernel's THP mode is
``always`` or ``madvise`` (:func:`set_default`), so a script that imports torchhpc (or ``torchhpc.accl``)
before its first tensor gets huge pages, and so do the processes it starts.  Measurements, sources and how
to opt out (``THP_MEM_ALLOC_ENABLE=0``): ``docs/accl.md``, "Huge pages for CPU tensors".
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # not typing's: collections.abc and typing would cost ``import torchhpc`` 2-10 ms
if TYPE_CHECKING:
    from collections.abc import MutableMapping

__all__ = ["VAR", "SYSFS", "TORCH_THRESHOLD", "NUMPY_THRESHOLD", "DOC", "INHERITED", "kernel_setting",
           "set_default", "huge_kib", "torch_thp_alloc"]

VAR = "THP_MEM_ALLOC_ENABLE"
SYSFS = "/sys/kernel/mm/transparent_hugepage"
TORCH_THRESHOLD = 2 << 20  # c10::gAlloc_threshold_thp
NUMPY_THRESHOLD = 4 << 20  # numpy/_core/src/multiarray/alloc.c: indicate_hugepages, size >= 1 << 22
DOC = "docs/accl.md, section 'Huge pages for CPU tensors'"

INHERITED: str | None = os.environ.get(VAR)
"""The variable as this process found it, before :func:`set_default` (None: unset)."""


def kernel_setting(name: str = "enabled", root: str | None = None) -> str | None:
    """The selected value (the one in brackets) of ``root/name`` (default :data:`SYSFS`), e.g. ``madvise``;
    None if not readable (a kernel without transparent huge pages)."""
    try:
        with open(os.path.join(root or SYSFS, name), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip() or None


def set_default(env: MutableMapping[str, str] | None = None, root: str | None = None) -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` in ``env`` (default ``os.environ``) unless it is set (a user's ``0``
    is kept) or the kernel's THP mode is ``never`` or absent (the variable would do nothing there).
    Returns whether it was set.  In the current process it takes effect only before torch's first CPU
    tensor allocation."""
    env = os.environ if env is None else env
    if VAR in env or kernel_setting("enabled", root) not in ("always", "madvise"):
        return False
    env[VAR] = "1"
    return True


def huge_kib(addr: int, nbytes: int, smaps: str = "/proc/self/smaps", field: str = "AnonHugePages") -> int:
    """KiB of huge pages (``field`` of smaps: ``AnonHugePages`` for private memory, ``ShmemPmdMapped`` for
    shared memory) in the mappings of this process that overlap ``[addr, addr + nbytes)`` (a buffer of its own
    mapping: its huge pages; 0 where smaps is unreadable)."""
    total, overlap = 0, False
    try:
        with open(smaps, encoding="utf-8", errors="replace") as f:
            for line in f:
                head = line.split(None, 1)[0] if line.strip() else ""
                if "-" in head and not head.endswith(":"):
                    lo, _, hi = head.partition("-")
                    try:
                        overlap = int(lo, 16) < addr + nbytes and addr < int(hi, 16)
                    except ValueError:
                        overlap = False
                elif overlap and head == field + ":":
                    total += int(line.split()[1])
    except OSError:
        return 0
    return total


def torch_thp_alloc(nbytes: int = 4 << 20) -> bool | None:
    """Whether torch in this process allocates ``nbytes`` with huge pages asked for (``THP_MEM_ALLOC_ENABLE``
    as latched at its first allocation), from libc10's ``c10_compute_alignment`` (page size: yes, 64: no);
    None where that symbol is missing.  Latches the variable itself if no tensor was allocated yet."""
    import ctypes

    import torch

    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        fn = ctypes.CDLL(lib)._ZN3c1021c10_compute_alignmentEm
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_size_t]
    return bool(fn(nbytes) >= 4096)
