"""What a ``torchhpc bench`` run measured: one :class:`Point` per (collective, ranks, size, implementation), the
nccl-tests bus-bandwidth factor, and the ``--json`` file that keeps a run for tables and plots later."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

__all__ = ["COLLECTIVES", "IMPLS", "DEFAULT_IMPLS", "LABELS", "RAW", "JSON_FORMAT", "Point", "bus_factor",
           "write_json", "read_json"]

COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall")
IMPLS = ("accl", "mpi-upstream", "gloo", "mpi4py", "mpi4py-numpy")
DEFAULT_IMPLS = ("accl", "mpi-upstream", "gloo", "mpi4py")
LABELS = {"accl": "accl", "mpi-upstream": "mpi-upstream", "gloo": "gloo",
          "mpi4py": "mpi(torch mem)", "mpi4py-numpy": "mpi(numpy mem)"}
RAW = "mpi4py"  # the baseline of the ratios
JSON_FORMAT = "torchhpc-bench/1"


@dataclass
class Point:
    """One measured (collective, ranks, size, implementation): each round's mean seconds per call."""

    collective: str
    ranks: int
    size: int
    impl: str
    rounds_s: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        """The median of the round means (seconds)."""
        return statistics.median(self.rounds_s)

    @property
    def spread(self) -> float:
        """(max - min) / median of the round means."""
        return (max(self.rounds_s) - min(self.rounds_s)) / self.median_s

    def busbw(self) -> float:
        """Bus bandwidth in GB/s (nccl-tests' definition)."""
        return self.size / self.median_s / 1e9 * bus_factor(self.collective, self.ranks)


def bus_factor(coll: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: what each rank's link carries relative to the buffer size."""
    if coll == "allreduce":
        return 2.0 * (n - 1) / n
    if coll in ("allgather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def write_json(path: str, meta: dict, points: Iterable[Point]) -> None:
    """Write ``meta`` and every point (round means and median, seconds) to ``path``."""
    rows = [dict(asdict(p), label=LABELS.get(p.impl, p.impl), median_s=p.median_s, busbw_GBps=p.busbw())
            for p in points]
    with open(path, "w") as f:
        json.dump({"meta": meta, "points": rows}, f, indent=1)
        f.write("\n")


def read_json(paths: Iterable[str]) -> tuple[list[dict], list[Point]]:
    """The metas and points of ``--json`` files (several runs, e.g. 2 and 4 ranks, merged)."""
    metas, points = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if data.get("meta", {}).get("format") != JSON_FORMAT:
            raise ValueError(f"{path}: not a `torchhpc bench --json` file ({JSON_FORMAT})")
        metas.append(data["meta"])
        points += [Point(r["collective"], r["ranks"], r["size"], r["impl"], list(r["rounds_s"]))
                   for r in data["points"]]
    return metas, points
