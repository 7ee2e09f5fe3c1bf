"""A submitted call's folder: what goes in (the pickled call, how to submit it again) and what comes out (each
rank's result or error and its output, the job's records), on a file system the nodes share, reachable by the
user alone.

Everything here is unpickled, so nothing is read from a folder or file another user owns or could write
(:func:`torchhpc.runtime.private.check_trusted`); files are written whole (a temporary name, then a rename), so a
reader sees a finished file or none.  Layout of ``<root>/<name>/`` (0700)::

    call.pkl          (fn, args, kwargs), cloudpickle     spec.json      how the job runs and is submitted again
    jobs              one scheduler record per submission  world.json    world size and nodes (rank 0, at start)
    rank-<r>.result   rank r's outcome, cloudpickle        rank-<r>.out, rank-<r>.err   its output, every attempt
    cancelled         present once the user cancelled: the job is not submitted again
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from ..runtime import private
from ..runtime.errors import TorchhpcError

__all__ = ["JobError", "create", "write_call", "read_call", "records", "write_json", "read_json",
           "write_outcome", "read_outcome", "every_rank_returned", "output_path", "CANCELLED"]

CANCELLED = "cancelled"


class JobError(TorchhpcError):
    """A submitted job failed, was ended by its scheduler, or left a result that cannot be read."""


def create(root: str | os.PathLike[str], name: str) -> Path:
    """A new folder ``root/name`` for one call, 0700 under a 0700 ``root`` (created or checked)."""
    folder = private.private_dir(root) / name
    os.mkdir(folder, 0o700)  # FileExistsError: names are unique, an existing one is not ours to reuse
    return folder


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read(path: Path) -> bytes:
    """The bytes of ``path``: a file of this user's that no one else can write, in a folder no one else can reach."""
    private.check_trusted(path.parent, private=True)
    private.check_trusted(path)
    return path.read_bytes()


def write_call(folder: Path, fn: Any, args: tuple, kwargs: dict, spec: dict) -> None:
    """The call to run on every rank, and the job's spec (JSON: how it runs, how to submit it again)."""
    import cloudpickle

    _write(folder / "call.pkl", cloudpickle.dumps((fn, args, kwargs)))
    write_json(folder, "spec.json", spec)


def read_call(folder: Path) -> tuple[Any, tuple, dict, dict]:
    """``(fn, args, kwargs, spec)`` as the submitter wrote them."""
    import pickle

    fn, args, kwargs = pickle.loads(_read(folder / "call.pkl"))
    return fn, args, kwargs, read_json(folder, "spec.json")


def write_json(folder: Path, name: str, value: Any) -> None:
    _write(folder / name, json.dumps(value).encode())


def read_json(folder: Path, name: str) -> Any:
    """The JSON file ``name`` of the folder, or None when it is not there (yet)."""
    try:
        return json.loads(_read(folder / name))
    except private.UnsafePathError:
        if not (folder / name).exists():
            return None
        raise


def records(folder: Path) -> list[dict[str, str]]:
    """One record per submission, oldest first: ``JOB_SCHEDULER``, ``JOB_ID``, ``JOB_LOG``, ... as
    ``utils/submit_job.sh --record`` appends them (shell-quoted ``NAME=value`` words)."""
    path = folder / "jobs"
    if not path.exists():
        return []
    out = []
    for line in _read(path).decode().splitlines():
        words = shlex.split(line)
        if words:
            out.append(dict(word.partition("=")[::2] for word in words))
    return out


def output_path(folder: Path, rank: int, stream: str) -> Path:
    """Where rank ``rank`` writes its ``out`` or ``err`` stream."""
    return folder / f"rank-{rank}.{stream}"


def write_outcome(folder: Path, rank: int, outcome: dict[str, Any]) -> None:
    """Rank ``rank``'s outcome: ``{"ok": True, "value": ...}`` or ``{"ok": False, "type", "message",
    "traceback", "host", "exception"}`` (the exception itself when it pickles, else None)."""
    import cloudpickle

    try:
        data = cloudpickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001  (any error of pickling: the value cannot travel)
        if not outcome.get("ok"):
            data = cloudpickle.dumps({**outcome, "exception": None})
        else:
            data = cloudpickle.dumps({"ok": False, "type": type(exc).__name__, "host": outcome.get("host", "?"),
                                      "message": f"its return value cannot be pickled: {exc}", "traceback": "",
                                      "exception": None})
    _write(_outcome_path(folder, rank), data)


def every_rank_returned(folder: Path) -> bool:
    """Whether the job's ranks started and each wrote its outcome (read nothing back)."""
    world = read_json(folder, "world.json")
    return world is not None and all(_outcome_path(folder, r).exists() for r in range(world["world_size"]))


def _outcome_path(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.result"


def read_outcome(folder: Path, rank: int, job: str) -> dict[str, Any] | None:
    """Rank ``rank``'s outcome, None when it wrote none; :class:`JobError` naming ``job`` and the rank when the
    file cannot be trusted or read back (truncated, from another version, not a pickle)."""
    import pickle

    path = _outcome_path(folder, rank)
    if not path.exists():
        return None
    try:
        outcome = pickle.loads(_read(path))
    except private.UnsafePathError as exc:
        raise JobError(f"{job}: rank {rank}'s result is not read: {exc}") from None
    except Exception as exc:  # noqa: BLE001  (unpickling raises anything)
        raise JobError(f"{job}: rank {rank}'s result {path} cannot be read back ({type(exc).__name__}: "
                       f"{exc})") from exc
    if not isinstance(outcome, dict) or "ok" not in outcome:
        raise JobError(f"{job}: rank {rank}'s result {path} is not an outcome torchhpc.submit wrote")
    return outcome
