"""``torchhpc frtrace DIR``: PyTorch's flight-recorder analyzer (``torchfrtrace``) on dumps that include accl's.

accl records every call in torch's own ``FlightRecorder`` and writes its dumps in torch's format
(``torchhpc.accl.dump_flight_record``), with entries named ``accl:<op>``.  torch 2.13's analyzer checks an entry's
backend prefix against a fixed list inside ``Op.__init__`` (nccl, gloo, xccl, ...), so it refuses them as they
stand.  This command is that analyzer, run unchanged (same arguments, same output) except that ``Op`` accepts
``accl``: each accl entry is parsed as torch parses its own and keeps its ``accl:`` name.  An open list upstream
(a backend registry the analyzer consults, as ``Backend.register_backend`` is for process groups) would make it
unnecessary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["main", "accl_accepted"]

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


def main(argv: Sequence[str] | None = None) -> int:
    """``torchfrtrace``'s command line (``torchhpc frtrace --help``), accl's entries accepted."""
    from torch.distributed.flight_recorder import fr_trace

    with accl_accepted():
        fr_trace.main(list(argv) if argv is not None else None)
    return 0
