"""Time grids of an MGRIT hierarchy and their block distribution over ranks.

Level 0 holds every fine point; level ``l + 1`` keeps every ``m_l``-th point of level ``l``
(injection coarsening).  Each rank owns a contiguous block of fine points; on a coarse
level it owns the coarse points whose fine index falls in its block (possibly none).
Every rank can describe every other rank's share, which lets layers and messages be
planned without negotiation.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Level", "Hierarchy", "even_split"]


def even_split(n: int, parts: int) -> list[int]:
    """``n`` items in ``parts`` blocks, the first ``n % parts`` blocks one larger (pymgrit's split)."""
    base, extra = divmod(n, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy as seen by one rank.

    Points are numbered ``0 .. npoints-1`` on the level; point ``J`` is fine point ``J * stride``.
    The rank owns points ``lo .. hi-1``; ``prev_owner`` owns ``lo - 1`` (the ghost point),
    ``next_owner`` owns ``hi``.
    """

    index: int
    stride: int
    npoints: int
    cfactor: int  # coarsening to the next level; 1 on the coarsest level
    lo: int
    hi: int
    prev_owner: int | None
    next_owner: int | None

    @property
    def empty(self) -> bool:
        return self.lo >= self.hi

    @property
    def has_ghost(self) -> bool:
        return not self.empty and self.lo > 0

    def is_c(self, j: int) -> bool:
        """Whether point ``j`` of this level is also a point of the next coarser level."""
        return j % self.cfactor == 0


class Hierarchy:
    """The levels of an MGRIT hierarchy over ``n`` fine points, distributed by ``counts``.

    ``cfactors[l]`` coarsens level ``l``; coarsening stops at ``max_levels`` or when the next
    level would have fewer than ``min_coarse`` points.
    """

    def __init__(self, n: int, counts: Sequence[int], cfactors: Sequence[int], max_levels: int,
                 min_coarse: int = 2) -> None:
        if n < 1:
            raise ValueError(f"need at least one time point, got {n}")
        if sum(counts) != n or any(c < 0 for c in counts):
            raise ValueError(f"partition {list(counts)} does not split {n} points")
        if max_levels < 1:
            raise ValueError(f"max_levels must be >= 1, got {max_levels}")
        self.n = n
        self.counts = list(counts)
        self.starts = [sum(self.counts[:r]) for r in range(len(self.counts))]
        self.nranks = len(self.counts)
        sizes, strides, factors = [n], [1], []
        while len(sizes) < max_levels:
            m = cfactors[min(len(sizes) - 1, len(cfactors) - 1)]
            if m < 2:
                raise ValueError(f"coarsening factor must be >= 2, got {m} on level {len(sizes) - 1}")
            nxt = (sizes[-1] - 1) // m + 1
            if nxt < min_coarse or nxt >= sizes[-1]:
                break
            factors.append(m)
            sizes.append(nxt)
            strides.append(strides[-1] * m)
        factors.append(1)
        self.sizes, self.strides, self.cfactors = sizes, strides, factors
        self.nlevels = len(sizes)

    def owner(self, fine_index: int) -> int:
        """Rank owning fine point ``fine_index`` (ranks with empty blocks never own anything)."""
        if not 0 <= fine_index < self.n:
            raise IndexError(fine_index)
        ends = [s + c for s, c in zip(self.starts, self.counts, strict=True)]
        return bisect.bisect_right(ends, fine_index)

    def level(self, lvl: int, rank: int) -> Level:
        """Level ``lvl`` as seen by ``rank``."""
        stride, npts = self.strides[lvl], self.sizes[lvl]
        f_lo, f_hi = self.starts[rank], self.starts[rank] + self.counts[rank]
        lo = min(-(-f_lo // stride), npts)
        hi = min(-(-f_hi // stride), npts)
        if lo >= hi:
            return Level(lvl, stride, npts, self.cfactors[lvl], lo, lo, None, None)
        prev_owner = self.owner((lo - 1) * stride) if lo > 0 else None
        next_owner = self.owner(hi * stride) if hi < npts else None
        return Level(lvl, stride, npts, self.cfactors[lvl], lo, hi, prev_owner, next_owner)

    def intervals(self, rank: int) -> set[tuple[int, int]]:
        """Fine-index intervals ``[i0, i1)`` that ``rank`` propagates over on any level."""
        out = set()
        for lvl in range(self.nlevels):
            lev = self.level(lvl, rank)
            for j in range(max(lev.lo, 1), lev.hi):
                out.add(((j - 1) * lev.stride, j * lev.stride))
            if lvl + 1 < self.nlevels:  # FAS restriction also steps the coarse grid at this rank's C-points
                nxt = self.level(lvl + 1, rank)
                for j in range(max(nxt.lo, 1), nxt.hi):
                    out.add(((j - 1) * nxt.stride, j * nxt.stride))
        return out
