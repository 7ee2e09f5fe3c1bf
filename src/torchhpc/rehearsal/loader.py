"""``RehearsalLoader``: one-line integration of a :class:`RehearsalBuffer` into a training loop."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .buffer import AugmentedBatch, RehearsalBuffer

__all__ = ["RehearsalLoader", "spare_rows_collate"]


def spare_rows_collate(buffer: RehearsalBuffer) -> Callable[[list[Any]], tuple]:
    """A DataLoader ``collate_fn`` that stacks each batch into tensors with ``R`` spare rows.

    It yields ``(samples, targets, out)``: ``samples``/``targets`` are the first ``b`` rows
    of the tensors in ``out`` (an :class:`AugmentedBatch`).  :class:`RehearsalLoader` passes
    ``out`` on, so the worker writes the representatives into the spare rows and never
    copies the new samples (tens of megabytes per step for image batches).  Dataset items
    are ``(sample, label)`` or ``((sample tensors...), label)``.
    """
    if buffer.mode != "standard":
        raise ValueError("spare_rows_collate needs a buffer in standard mode")
    if buffer.stores_activations:
        raise ValueError("spare_rows_collate does not build activations; use RehearsalLoader(activations=...)")

    def collate(items: list[Any]) -> tuple:
        b = len(items)
        rows = b + buffer.R
        firsts = [item[0] if isinstance(item[0], (tuple, list)) else (item[0],) for item in items]
        full = []
        for i, (shape, dtype) in enumerate(zip(buffer.sample_shapes, buffer.sample_dtypes, strict=True)):
            t = torch.empty((rows, *shape), dtype=dtype)
            torch.stack([torch.as_tensor(f[i], dtype=dtype) for f in firsts], out=t[:b])
            full.append(t)
        targets = torch.empty(rows, dtype=torch.int64)
        targets[:b] = torch.as_tensor([int(item[1]) for item in items], dtype=torch.int64)
        out = AugmentedBatch(full if buffer.multi else full[0], targets, torch.empty(rows), None)
        samples = [t[:b] for t in full]
        return (samples if buffer.multi else samples[0], targets[:b], out)

    return collate


class RehearsalLoader:
    """Wrap any iterable of ``(samples, targets)`` (or ``(samples, targets, activations)``) batches.

    Iterating yields :class:`AugmentedBatch` es.  Batch ``i+1`` is handed to the buffer's
    worker before batch ``i`` is yielded, so its rehearsal (sampling, remote fetch, update)
    runs while the caller trains on batch ``i``::

        for samples, targets, weights, _ in RehearsalLoader(loader, buffer):
            ...

    For the ``kd`` tasks give ``activations``, a callable mapping the new samples to the
    activations to store (e.g. ``lambda x: model(x).detach()``), unless the wrapped loader
    already yields them.  A loader built with :func:`spare_rows_collate` yields
    ``(samples, targets, out)`` and saves the copy of the new samples.  The buffer must be in
    standard mode.
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
        out = batch[2] if len(batch) == 3 and isinstance(batch[2], AugmentedBatch) else None
        acts = batch[2] if len(batch) == 3 and out is None else None
        if acts is None and self.activations is not None:
            with torch.no_grad():
                acts = self.activations(samples)
        self.buffer.accumulate(samples, targets, acts, out=out)

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
