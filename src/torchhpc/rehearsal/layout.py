"""Byte layout of one rank's buffer: a small header of per-class fill counts, then K x N slot records.

A record holds everything about one stored representative (label, its sample tensors, its
activation) side by side, so one slot is one contiguous byte range: remote ranks fetch
it with one-sided reads and an update rewrites it as a unit under one lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Field", "RecordLayout", "ALIGN"]

ALIGN = 64  # cache line: every field and record starts on one


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Field:
    """One tensor stored in every record: its name, per-sample shape, dtype and byte offset in the record."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize  # no tensor made: this sits on the fetch path


class RecordLayout:
    """Where each field of each slot lives in the flat byte storage of one rank."""

    def __init__(
        self,
        num_classes: int,
        slots_per_class: int,
        sample_shapes: list[tuple[int, ...]],
        sample_dtypes: list[torch.dtype],
        activation_shape: tuple[int, ...] | None,
        activation_dtype: torch.dtype,
    ) -> None:
        self.num_classes = num_classes
        self.slots_per_class = slots_per_class
        self.num_slots = num_classes * slots_per_class
        fields = []
        offset = 0
        fields.append(Field("label", (), torch.int64, offset))
        offset = _align(offset + 8)
        for i, (shape, dtype) in enumerate(zip(sample_shapes, sample_dtypes, strict=True)):
            f = Field(f"sample{i}", tuple(shape), dtype, offset)
            fields.append(f)
            offset = _align(offset + f.nbytes)
        if activation_shape is not None:
            f = Field("activation", tuple(activation_shape), activation_dtype, offset)
            fields.append(f)
            offset = _align(offset + f.nbytes)
        self.fields = fields
        self.label = fields[0]
        self.samples = [f for f in fields if f.name.startswith("sample")]
        self.activation = fields[-1] if activation_shape is not None else None
        self.record_bytes = offset
        self.header_bytes = _align(8 * num_classes)
        self.total_bytes = self.header_bytes + self.num_slots * self.record_bytes

    def record_offset(self, flat_slot: int) -> int:
        """Byte offset of a record (``flat_slot = label * N + slot``) from the start of the storage."""
        return self.header_bytes + flat_slot * self.record_bytes

    def fills(self, storage: torch.Tensor) -> torch.Tensor:
        """The per-class fill counts (int64 view of the header)."""
        return storage[: 8 * self.num_classes].view(torch.int64)

    def view(self, storage: torch.Tensor, field: Field) -> torch.Tensor:
        """A ``(K*N, *field.shape)`` tensor view of ``field`` in every record of ``storage`` (uint8)."""
        records = storage[self.header_bytes :].view(self.num_slots, self.record_bytes)
        column = records[:, field.offset : field.offset + field.nbytes].view(field.dtype)
        return column.view(self.num_slots, *field.shape)

    def describe(self) -> dict:
        """A picklable description used to check that a saved state matches this layout."""
        return {
            "num_classes": self.num_classes,
            "slots_per_class": self.slots_per_class,
            "fields": [(f.name, f.shape, str(f.dtype)) for f in self.fields],
        }
