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


def main(argv: Sequence[str] | None = None) -> int:
    """``torchfrtrace``'s command line (``torchhpc frtrace --help``), accl's entries accepted, dumps that are
    not the user's refused unless ``--trust-others``."""
    from torch.distributed.flight_recorder import fr_trace
    from torch.distributed.flight_recorder.components.config_manager import JobConfig

    args = list(sys.argv[1:] if argv is None else argv)
    trust = TRUST in args
    args = [a for a in args if a != TRUST]
    trace_dir = getattr(JobConfig().parse_args(args), "trace_dir", None)
    if trace_dir and not trust:
        try:
            check_dumps(trace_dir)
        except private.UnsafePathError as exc:
            print(f"torchhpc frtrace: refusing to read {trace_dir}: {exc}.\nDumps are pickles, and reading one "
                  f"runs whatever its writer put in it; pass {TRUST} if you trust whoever else could write there.",
                  file=sys.stderr)
            return 2
    with accl_accepted():
        fr_trace.main(args)
    return 0
