"""How torchhpc's benchmarks time a call: a loop of calls on one process, the slowest rank's figure, and rounds
interleaved across the things compared so that a noisy, shared machine hurts each of them alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

__all__ = ["per_call_s", "slowest", "mean_call_time", "interleaved", "summary"]


def per_call_s(fn: Callable[[], object], iters: int) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` back-to-back calls on this process."""
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def slowest(comm, seconds: float) -> float:
    """The largest of every rank's ``seconds`` (a collective on ``comm``)."""
    from mpi4py import MPI

    return comm.allreduce(seconds, op=MPI.MAX)


def mean_call_time(fn: Callable[[], object], comm, budget_s: float, quick: bool = False,
                   max_iters: int = 2000) -> float:
    """Mean seconds per call of ``fn`` on the slowest rank of ``comm``, over as many calls as fit ``budget_s``
    (at least 5, or 3 with ``quick``; at most ``max_iters``) after warm-up calls; the iteration count is agreed
    across ranks, so collectives stay matched."""
    fn()
    fn()
    comm.Barrier()
    one = slowest(comm, per_call_s(fn, 1))
    iters = int(max(3 if quick else 5, min(max_iters, budget_s / max(one, 1e-7))))
    comm.Barrier()
    return slowest(comm, per_call_s(fn, iters))


def interleaved(fns: Mapping[str, Callable[[], object]], repeats: int,
                measure: Callable[[Callable[[], object]], float]) -> dict[str, list[float]]:
    """``measure(fn)`` of every entry of ``fns`` in ``repeats`` rounds, round r starting r entries further along,
    so that no entry is always first after the others; each entry's figures in round order."""
    names = list(fns)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(measure(fns[name]))
    return out


def summary(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values``."""
    return statistics.median(values), min(values), max(values)
