"""``torchhpc frtrace DIR``: PyTorch's flight-recorder analyzer (``torchfrtrace``) on dumps that include accl's.

accl records every call in torch's own ``FlightRecorder`` and writes its dumps in torch's format
(``torchhpc.accl.dump_flight_record``), with entries named ``accl:<op>``.  torch 2.13's analyzer checks an entry's
backend prefix against a fixed list inside ``Op.__init__`` (nccl, gloo, xccl, ...), so it refuses them as they
stand.  This command is that analyzer, run unchanged (same arguments, same output) except that ``Op`` accepts
``accl``: each accl entry is parsed as torch parses its own and keeps its ``accl:`` name.  An open list upstream
(a backend registry the analyzer consults, as ``Backend.register_backend`` is for process groups) would make it
unnecessary.

torch's loader unpickles every file under DIR: a file another user planted there would run code as the user.  The
command first checks that every file and folder under DIR is the user's and writable by no one else, and refuses
otherwise, saying which and why; ``--trust-others`` reads dumps another user wrote (a colleague's job) anyway.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .runtime import private

__all__ = ["main", "accl_accepted", "check_dumps"]

TRUST = "--trust-others"

PREFIX = "accl:"


@contextlib.contextmanager
def accl_accepted() -> Iterator[None]:
    """While inside: torch's analyzer components parse ``accl:<op>`` entries like their own."""
    from torch.distributed.flight_recorder.components import builder, types, utils

    class Op(types.Op):
        """torch's ``Op``, past its closed list of backend prefixes for accl's entries."""

        def __init__(self, event: dict[Any, Any], memberships: dict[str, set[Any]], pg_name: str) -> None:
            name = event["profiling_name"]
            if not name.startswith(PREFIX):
                super().__init__(event, memberships, pg_name)
                return
            # the prefix is only checked against the list, never used: parse under a listed one, keep accl's name
            super().__init__({**event, "profiling_name": "gloo:" + name[len(PREFIX):]}, memberships, pg_name)
            self.profiling_name = name

    saved = builder.Op, utils.Op
    builder.Op = utils.Op = Op
    try:
        yield
    finally:
        builder.Op, utils.Op = saved


def check_dumps(trace_dir: str | os.PathLike[str]) -> None:
    """Raise :class:`torchhpc.runtime.private.UnsafePathError` unless ``trace_dir`` and everything torch's loader would
    read under it (it walks the tree) is this user's and writable by no one else."""
    for folder, _, files in os.walk(trace_dir):
        private.check_trusted(folder)
        for name in files:
            private.check_trusted(Path(folder) / name)


ABOUT = """Which rank hung, and in which call: PyTorch's flight-recorder analyzer (torchfrtrace), reading accl's
records as well as nccl's and gloo's.  accl writes each rank's record to $TORCH_FR_DUMP_TEMP_FILE<rank> when a
call times out, a peer dies or the ranks' calls differ (export TORCH_FR_DUMP_TEMP_FILE=$SCRATCH/fr/rank_ before the
launch, a folder every rank can reach); give that folder as trace_dir."""

TRUST_HELP = ("read dumps that another user could have written (they are pickles: reading one runs what its writer "
              "put in it); without it, every file and folder under trace_dir must be yours and writable only by you")


def _parser() -> Any:
    """torch's own argument parser, under this command's name and with what it adds."""
    from torch.distributed.flight_recorder.components.config_manager import JobConfig

    config = JobConfig()
    config.parser.prog = "torchhpc frtrace"
    config.parser.description = ABOUT
    config.parser.add_argument(TRUST, action="store_true", help=TRUST_HELP)
    return config


def _refuse(message: str) -> int:
    print(f"torchhpc frtrace: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``torchfrtrace``'s command line (``torchhpc frtrace --help``), accl's entries accepted, dumps that are
    not the user's refused unless ``--trust-others``; a missing, empty or unreadable folder is said in words."""
    import pickle

    from torch.distributed.flight_recorder import fr_trace

    args = list(sys.argv[1:] if argv is None else argv)
    parsed = _parser().parse_args(args)  # --help and bad flags end here, as argparse does
    args = [a for a in args if a != TRUST]
    trace_dir = parsed.trace_dir
    if not trace_dir:
        return _refuse("give the folder of the flight records (where TORCH_FR_DUMP_TEMP_FILE pointed: "
                       "torchhpc frtrace $SCRATCH/fr); see torchhpc frtrace --help")
    if not os.path.isdir(trace_dir):
        return _refuse(f"{trace_dir} is not a folder" if os.path.exists(trace_dir) else f"{trace_dir} does not exist")
    if not any(files for _, _, files in os.walk(trace_dir)):
        return _refuse(f"{trace_dir} holds no flight records: a rank writes one (TORCH_FR_DUMP_TEMP_FILE<rank>) only "
                       "on a timeout, a dead peer or a mismatch, or when the program calls "
                       "torchhpc.accl.dump_flight_record()")
    if not parsed.trust_others:
        try:
            check_dumps(trace_dir)
        except private.UnsafePathError as exc:
            return _refuse(f"refusing to read {trace_dir}: {exc}.\nDumps are pickles, and reading one runs whatever "
                           f"its writer put in it; pass {TRUST} if you trust whoever else could write there.")
    try:
        with accl_accepted():
            fr_trace.main(args)
    except PermissionError as exc:
        return _refuse(f"cannot read {exc.filename}: permission denied")
    except (pickle.UnpicklingError, EOFError, KeyError) as exc:
        return _refuse(f"a file under {trace_dir} is not a flight record ({type(exc).__name__}: {exc}); give "
                       "a folder that holds only the records, or name their common prefix with --prefix")
    except ValueError as exc:
        if "common prefix" not in str(exc):
            raise
        return _refuse(f"the files under {trace_dir} do not share one name prefix followed by a rank (rank_0, "
                       "rank_1, ...); name it with --prefix, or give a folder that holds only one job's records")
    return 0
