"""Choosing representatives uniformly from a buffer spread over ranks."""

from __future__ import annotations

import numpy as np

__all__ = ["draw_representatives"]


def draw_representatives(
    fills: np.ndarray, slots_per_class: int, count: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``min(count, fills.sum())`` distinct stored slots uniformly from all ranks' buffers.

    ``fills[p, k]`` is how many slots of class ``k`` rank ``p`` holds (slots ``0..fill-1`` are
    the filled ones).  Returns ``(ranks, flat_slots)`` sorted by rank then slot, where
    ``flat_slot = k * slots_per_class + slot``.  Every stored sample is equally likely,
    whichever rank holds it and however full each class is.
    """
    flat = np.ascontiguousarray(fills, dtype=np.int64).reshape(-1)
    total = int(flat.sum())
    m = min(int(count), total)
    if m <= 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    picks = rng.choice(total, size=m, replace=False)
    ends = np.cumsum(flat)
    cell = np.searchsorted(ends, picks, side="right")
    offset = picks - (ends[cell] - flat[cell])
    num_classes = fills.shape[1]
    ranks = cell // num_classes
    flat_slots = (cell % num_classes) * slots_per_class + offset
    order = np.lexsort((flat_slots, ranks))
    return ranks[order], flat_slots[order]
