"""``torchhpc bench``: collective benchmarks, accl against PyTorch's own MPI backend, gloo and raw MPI on the same
memory.  One module per job: :mod:`.cli` (the command), :mod:`.runners` (the calls and their groups),
:mod:`.timing` (interleaved rounds, the slowest rank), :mod:`.results` (points, JSON), :mod:`.report` (the
tables) and :mod:`.plot` (matplotlib).  ``bench/accl_*.py`` reuse :mod:`.timing`."""

from __future__ import annotations

from .cli import main

__all__ = ["main"]
