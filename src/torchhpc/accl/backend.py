"""Registration of the ``"accl"`` backend with torch.distributed, and group creation over MPI.

torch's ``new_group`` is collective over the whole world, but it calls a backend's creator only on
the group's members (``distributed_c10d._new_process_group_helper`` returns ``NON_GROUP_MEMBER`` to
the others first).  A subgroup's communicator is therefore made with ``MPI_Comm_create_group``,
which only the members call, on a world-ordered communicator.  Its tag must be the same on every
member and differ between groups whose creations may overlap in time, whatever groups each member
joined before: it is derived from torch's group name, which every rank numbers alike (a global
counter that non-members advance too), or, for hashed names (``use_local_synchronization=True``),
from the member list and how many groups of exactly those members this rank created before.

``MPI_Comm_create_group`` has no timeout, so the members first meet in a handshake polled against the
group's timeout (each member reports to the first member, which answers all): a member that never
comes gives a :class:`~torchhpc.runtime.errors.PeerTimeoutError` naming it, and a member whose own checks
failed makes every member raise (:class:`~torchhpc.runtime.errors.RemoteError` naming it).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import struct
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from mpi4py import MPI
from mpi4py.run import set_abort_status

from ..runtime.errors import EngineUnavailableError, PeerTimeoutError, RemoteError
from ..runtime.waiting import agree, agreed, wait_requests
from . import core
from .group import ProcessGroupACCL
from .options import AcclOptions
from .rendezvous import install_env_rendezvous

__all__ = ["register", "create_process_group"]

_lock = threading.Lock()
_world_comm: MPI.Comm | None = None  # MPI ranks ordered as torch's global ranks
_ctl_comm: MPI.Comm | None = None  # its duplicate, for creation handshakes (no user traffic on it)
_created: dict[tuple[int, ...], int] = {}  # groups created per exact member list (hashed names only)
_exit_timeout_s = 0.0  # the default group's timeout: how long the barrier at exit waits for the other ranks

_MSG = struct.Struct("=qq")  # status (0 ok, 1 failed), digest of the member list; then error text
_MSG_BYTES = 1024


def _global_comm(group_rank: int, group_size: int, is_default: bool) -> MPI.Comm:
    """A communicator whose rank i is torch's global rank i."""
    global _world_comm, _ctl_comm
    world = MPI.COMM_WORLD
    if is_default:
        comm = world if group_rank == world.Get_rank() else world.Split(0, group_rank)
        _world_comm, _ctl_comm = comm, comm.Dup()
        return comm
    if _world_comm is not None:
        return _world_comm
    # default group from another backend (e.g. gloo): its ranks must be MPI's
    if dist.is_initialized() and dist.get_rank() != world.Get_rank():
        raise RuntimeError("accl: the default group's ranks differ from MPI_COMM_WORLD's; create the "
                           "default group with the accl backend, or launch so that RANK matches the MPI rank")
    return world


def _tag_space() -> int:
    ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    return int(ub) if ub else 32767


def creation_tag(ranks: Sequence[int], group_name: str) -> int:
    """The tag every member of the group ``ranks`` named ``group_name`` uses to create it (see module doc).

    Numbered names use the lower half of the tag space, hashed names the upper half; advances this
    rank's count of groups with exactly these members when the name is hashed."""
    space = _tag_space()
    half = space // 2
    if group_name.isdigit():
        return int(group_name) % half
    key = tuple(ranks)
    n = _created.get(key, 0)
    _created[key] = n + 1
    digest = hashlib.blake2b(f"{key}/{n}".encode(), digest_size=8).digest()
    return half + int.from_bytes(digest, "little") % (space - half)


def _digest(ranks: Sequence[int]) -> int:
    return int.from_bytes(hashlib.blake2b(repr(list(ranks)).encode(), digest_size=7).digest(), "little")


def _message(status: int, digest: int, text: str) -> bytearray:
    buf = bytearray(_MSG_BYTES)
    _MSG.pack_into(buf, 0, status, digest)
    raw = text.encode(errors="replace")[: _MSG_BYTES - _MSG.size]
    buf[_MSG.size:_MSG.size + len(raw)] = raw
    return buf


def _unpack(buf: bytearray) -> tuple[int, int, str]:
    status, digest = _MSG.unpack_from(buf, 0)
    return status, digest, bytes(buf[_MSG.size:]).rstrip(b"\0").decode(errors="replace")


def _handshake(ctl: MPI.Comm, ranks: list[int], tag: int, error: BaseException | None, timeout: float,
               what: str) -> None:
    """Members of ``ranks`` meet before ``MPI_Comm_create_group`` (which cannot time out): each reports ok
    or its error to the first member, which answers all.  Raises on every member if any failed or one
    did not come within ``timeout``; a member that failed itself returns (its caller re-raises)."""
    me = ctl.Get_rank()
    digest = _digest(ranks)
    mine = _message(0 if error is None else 1, digest,
                    "" if error is None else f"rank {me}: {type(error).__name__}: {error}")
    meet = _lead if me == ranks[0] else _report
    try:
        status, text = meet(ctl, ranks, tag, mine, digest, timeout, what)
    except PeerTimeoutError:
        if error is None:
            raise
        return
    if status and error is None:
        first = int(text.split(":", 1)[0].removeprefix("rank ")) if text.startswith("rank ") else -1
        raise RemoteError(f"{what} failed on another member ({text}); rank {me} stops too", first, text)


def _report(ctl: MPI.Comm, ranks: list[int], tag: int, mine: bytearray, digest: int, timeout: float,
            what: str) -> tuple[int, str]:
    """A member's side: send its report to the first member and wait for the verdict (status, text)."""
    me, leader = ctl.Get_rank(), ranks[0]
    verdict = bytearray(_MSG_BYTES)
    send = ctl.Isend([mine, MPI.BYTE], leader, tag)
    wait_requests([ctl.Irecv([verdict, MPI.BYTE], leader, tag)], timeout, what, keep=verdict,
                  cancel=True, message=lambda: (
                      f"{what}: rank {me} got no answer from the group's first rank {leader} within "
                      f"{timeout:g} s: it did not call new_group for this group (every rank must "
                      "create the same groups in the same order), died, or is stuck"))
    send.Wait()  # matched: the leader answered after receiving it
    status, _, text = _unpack(verdict)
    return status, text


def _lead(ctl: MPI.Comm, ranks: list[int], tag: int, mine: bytearray, digest: int, timeout: float,
          what: str) -> tuple[int, str]:
    """The first member's side: gather every report, answer all with the first failure (or ok)."""
    leader = ranks[0]
    others = [r for r in ranks if r != leader]
    bufs = {r: bytearray(_MSG_BYTES) for r in others}
    reqs = {r: ctl.Irecv([bufs[r], MPI.BYTE], r, tag) for r in others}
    wait_requests(list(reqs.values()), timeout, what, keep=bufs, cancel=True, message=lambda: (
        f"{what}: ranks {[r for r in others if not reqs[r].Test()]} did not join within {timeout:g} s "
        "(every rank must create the same groups in the same order; a rank that died or is stuck "
        "never joins)"))
    failures = [mine] if _unpack(mine)[0] else []
    for r in others:
        status, their_digest, _ = _unpack(bufs[r])
        if status:
            failures.append(bufs[r])
        elif their_digest != digest:
            failures.append(_message(1, digest, f"rank {r}: created a group with other members than "
                                                f"rank {leader}'s {ranks} under the same tag"))
    answer = failures[0] if failures else _message(0, digest, "")
    if len(failures) > 1:
        text = _unpack(failures[0])[2]
        answer = _message(1, digest, f"{text} (and {len(failures) - 1} more failing ranks)")
    wait_requests([ctl.Isend([answer, MPI.BYTE], r, tag) for r in others], timeout, what, keep=answer)
    status, _, text = _unpack(answer)
    return status, text


def _leave() -> None:
    """At exit, before MPI_Finalize, which waits for every rank without a deadline: a process whose accl group saw
    peers die ends the job with MPI_Abort; otherwise the ranks meet at a barrier, where each waits at most the
    default group's timeout (or the timeout of its group that timed out on silent peers) before MPI_Abort.  A
    stopped node or a cut link must not hold the job for ever, also when the ranks noticed it outside accl (a
    rehearsal or chunkstore deadline) or not at all (the peer stopped after the last collective); ranks that
    recovered from a timeout all arrive and finalize as usual."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    try:
        died, silent_s = core.load_backend().peers_lost()
    except EngineUnavailableError:  # the backend is not built: no group was made, none saw a peer
        died, silent_s = False, 0.0
    if not died and _met_at_exit(silent_s):
        return
    why = "saw peers die" if died else \
        f"waited {silent_s or _exit_timeout_s:g} s at exit for peers that did not come (stopped, cut off or dead)"
    sys.stderr.write(f"torchhpc.accl: this process {why}: ending the job with MPI_Abort, as "
                     f"MPI_Finalize would wait for them for ever\n")
    # mpi4py calls MPI_Abort in place of MPI_Finalize, last thing at exit (as this path always did for deaths).
    # Open MPI 5.0.11's prterun can deadlock when two survivors abort at once under ULFM, by this path or not.
    set_abort_status(1)
    core.load_backend().arm_abort_grace()  # MPI_Abort cannot reach a launcher behind a cut link


@functools.cache
def _leave_at_exit() -> None:
    """Register :func:`_leave` once, when this process makes its first accl group (never at import: a process
    that only imports accl, such as ``make env`` before the backend is built, has nothing to do at exit)."""
    atexit.register(_leave)


def _met_at_exit(silent_s: float) -> bool:
    """Whether the ranks met at the barrier at exit within ``silent_s`` when this process's group timed out on
    silent peers, else within the default group's timeout.  Without the default accl group there is none to
    meet at."""
    if _ctl_comm is None:
        return not silent_s
    try:
        wait_requests([_ctl_comm.Ibarrier()], silent_s or _exit_timeout_s, "accl: the barrier at exit")
    except PeerTimeoutError:
        return False
    return True


def create_process_group(dist_opts, pg_options=None) -> ProcessGroupACCL:
    """``Backend.register_backend`` creator (extended API): builds the group's MPI communicator.

    Called by torch on the group's members only; every member either gets the group or raises.  The first group
    of the process also registers the exit hook (:func:`_leave`): before MPI_Finalize the ranks meet within the
    default group's timeout, or the job ends with MPI_Abort."""
    global _exit_timeout_s
    _leave_at_exit()
    ranks = list(dist_opts.global_ranks_in_group)
    rank, size = dist_opts.group_rank, dist_opts.group_size
    timeout: timedelta = dist_opts.timeout if dist_opts.timeout is not None else dist.default_pg_timeout
    timeout_s = timeout.total_seconds()
    name = str(dist_opts.group_id)
    error: Exception | None = None
    try:
        if pg_options is not None and not isinstance(pg_options, AcclOptions):
            raise TypeError(f"accl: pg_options must be torchhpc.accl.AcclOptions, "
                            f"got {type(pg_options).__name__}")
    except Exception as exc:  # noqa: BLE001 - every member hears of it below
        error = exc
    with _lock:
        if not ranks:  # the default group: every rank of the job is here
            world = MPI.COMM_WORLD
            if error is None and size != world.Get_size():
                error = RuntimeError(f"accl: torch world_size {size} differs from the MPI job size "
                                     f"{world.Get_size()}; the accl backend needs one torch rank per MPI process")
            agree(world, error, timeout_s, "accl: init_process_group")
            if error is not None:
                raise error
            comm = _global_comm(rank, size, is_default=True)
            _exit_timeout_s = timeout_s
        else:
            base = _global_comm(rank, size, is_default=False)
            ctl = _ctl_comm if base is _world_comm and _ctl_comm is not None else base
            tag = creation_tag(ranks, name)
            what = f"accl: creating group '{name}' of ranks {ranks}"
            _handshake(ctl, ranks, tag, error, timeout_s, what)
            if error is not None:
                raise error
            if ranks == list(range(base.Get_size())):
                comm = base
            else:
                group = base.Get_group().Incl(ranks)
                comm = base.Create_group(group, tag)
                group.Free()
    with agreed(comm, timeout_s, f"accl: setting up group '{name}'"):
        pg = ProcessGroupACCL(comm, rank, size, timeout, pg_options, name, global_ranks=ranks)
    return pg


def register() -> None:
    """Make ``init_process_group("accl")`` work (idempotent)."""
    if "ACCL" not in dist.Backend._plugins:
        dist.Backend.register_backend("accl", create_process_group, extended_api=True,
                                      devices=["cpu", "cuda"])
    install_env_rendezvous()
