"""``RehearsalLoader``: one-line integration of a :class:`RehearsalBuffer` into a training loop."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .buffer import AugmentedBatch, RehearsalBuffer

__all__ = ["RehearsalLoader"]


class RehearsalLoader:
    """Wrap any iterable of ``(samples, targets)`` (or ``(samples, targets, activations)``) batches.

    Iterating yields :class:`AugmentedBatch` es.  Batch ``i+1`` is handed to the buffer's
    worker before batch ``i`` is yielded, so its rehearsal (sampling, remote fetch, update)
    runs while the caller trains on batch ``i``::

        for samples, targets, weights, _ in RehearsalLoader(loader, buffer):
            ...

    For the ``kd`` tasks give ``activations``, a callable mapping the new samples to the
    activations to store (e.g. ``lambda x: model(x).detach()``), unless the wrapped loader
    already yields them.  The buffer must be in standard mode.
    """

    def __init__(
        self,
        dataloader: Iterable[Any],
        buffer: RehearsalBuffer,
        activations: Callable[[torch.Tensor | list[torch.Tensor]], torch.Tensor] | None = None,
    ) -> None:
        if buffer.mode != "standard":
            raise ValueError("RehearsalLoader needs a buffer in standard mode")
        self.dataloader = dataloader
        self.buffer = buffer
        self.activations = activations

    def __len__(self) -> int:
        return len(self.dataloader)  # type: ignore[arg-type]

    def _submit(self, batch: Any) -> None:
        if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
            raise ValueError("the wrapped loader must yield (samples, targets[, activations]) tuples")
        samples, targets = batch[0], batch[1]
        acts = batch[2] if len(batch) == 3 else None
        if acts is None and self.activations is not None:
            with torch.no_grad():
                acts = self.activations(samples)
        self.buffer.accumulate(samples, targets, acts)

    def __iter__(self) -> Iterator[AugmentedBatch]:
        it = iter(self.dataloader)
        try:
            first = next(it)
        except StopIteration:
            return
        self._submit(first)
        pending = True
        try:
            for batch in it:
                ready = self.buffer.wait()
                pending = False
                self._submit(batch)
                pending = True
                yield ready
            pending = False
            yield self.buffer.wait()
        finally:
            if pending:  # the caller stopped early: drain the batch in flight
                self.buffer.wait()
