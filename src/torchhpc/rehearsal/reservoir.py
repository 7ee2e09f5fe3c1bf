"""Per-class reservoir sampling (Algorithm R) deciding which candidates enter which buffer slot.

This module holds only the bookkeeping (counts and random decisions), not the data, so the
policy can be tested statistically on millions of draws without touching any tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ClassReservoir", "SlotWrites"]


@dataclass(frozen=True)
class SlotWrites:
    """Decisions for one minibatch: candidate ``rows[i]`` goes to slot ``slots[i]`` of class ``labels[i]``.

    Each (class, slot) appears at most once: when several candidates of a batch land on the
    same slot only the last one (in stream order) is kept, exactly as if they were written in
    sequence.
    """

    rows: np.ndarray
    labels: np.ndarray
    slots: np.ndarray


class ClassReservoir:
    """Algorithm R applied independently to every class.

    For class ``k`` with ``seen_k`` candidates offered so far, the ``seen_k``-th candidate is
    stored while the class has a free slot, and afterwards replaces a uniformly chosen slot
    with probability ``N / seen_k``.  Every candidate of a class is therefore retained with the
    same probability ``N / seen_k`` whatever its position in the stream (no recency bias), and
    each class gets at most ``N`` slots (class balance by construction).
    """

    def __init__(self, num_classes: int, slots_per_class: int) -> None:
        if num_classes < 1 or slots_per_class < 1:
            raise ValueError(
                f"num_classes and slots_per_class must be >= 1, got {num_classes} and {slots_per_class}"
            )
        self.num_classes = num_classes
        self.slots_per_class = slots_per_class
        self.fill = np.zeros(num_classes, dtype=np.int64)
        self.seen = np.zeros(num_classes, dtype=np.int64)

    def offer(self, labels: np.ndarray, rng: np.random.Generator) -> SlotWrites:
        """Offer candidates with class ``labels`` (in stream order); return the slot writes to apply."""
        labels = np.asarray(labels, dtype=np.int64)
        n = self.slots_per_class
        chosen: dict[tuple[int, int], int] = {}
        for row, label in enumerate(labels.tolist()):
            self.seen[label] += 1
            if self.fill[label] < n:
                slot = int(self.fill[label])
                self.fill[label] += 1
            else:
                j = int(rng.integers(0, self.seen[label]))
                if j >= n:
                    continue
                slot = j
            chosen[(label, slot)] = row  # a later candidate on the same slot overwrites the earlier one
        if not chosen:
            empty = np.empty(0, dtype=np.int64)
            return SlotWrites(empty, empty, empty)
        keys = list(chosen)
        return SlotWrites(
            rows=np.fromiter(chosen.values(), dtype=np.int64, count=len(keys)),
            labels=np.fromiter((k[0] for k in keys), dtype=np.int64, count=len(keys)),
            slots=np.fromiter((k[1] for k in keys), dtype=np.int64, count=len(keys)),
        )

    def state_dict(self) -> dict[str, np.ndarray]:
        """Counts needed to continue the stream exactly after a restart."""
        return {"fill": self.fill.copy(), "seen": self.seen.copy()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restore counts saved by :meth:`state_dict` (shapes are checked)."""
        fill = np.asarray(state["fill"], dtype=np.int64)
        seen = np.asarray(state["seen"], dtype=np.int64)
        if fill.shape != (self.num_classes,) or seen.shape != (self.num_classes,):
            raise ValueError(
                f"reservoir state has {fill.shape[0]} classes, this buffer has {self.num_classes}"
            )
        if (fill > self.slots_per_class).any() or (fill > seen).any() or (fill < 0).any():
            raise ValueError("reservoir state is inconsistent (fill > slots_per_class or fill > seen)")
        self.fill[:] = fill
        self.seen[:] = seen
