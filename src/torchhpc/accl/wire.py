"""The accl wire protocol, defined once: the collective consistency header and the p2p envelope.

**Collective header.**  Before a checked collective every rank contributes one fixed-size *slot*
to an all-gather on the group's control communicator.  A slot is ``SLOT_BYTES`` long: a header of
``HEADER_BYTES`` (nine int64 fields, :data:`FIELDS`, then zero padding) followed by a payload area
of ``PAYLOAD_BYTES`` (the data of small all_reduce, broadcast, all_gather and reduce_scatter calls
rides there, so the exchange is the whole collective; all_to_all puts its send/receive byte matrix row
there, followed by its sends when they fit).  Once gathered, every rank compares the leading fields of every slot; a
difference is reported by :func:`describe_mismatch`, which names the field, the ranks and their
values.

**P2P envelope.**  Every ``send`` starts with one slot-sized message on the header channel: the
:data:`ENVELOPE` fields (magic, dtype, bytes, numel) and, up to ``PAYLOAD_BYTES``, the payload
itself; larger payloads follow on the payload channel, posted by the receiver only after it checked
the envelope (so a bad message is drained, never matched by a later receive).

Both are plain little-endian-native ``struct`` layouts, packed and unpacked only here.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "MAGIC", "HEADER", "HEADER_BYTES", "PAYLOAD_BYTES", "SLOT_BYTES", "FIELDS", "KINDS", "DTYPES", "OPS",
    "Header", "Envelope", "ENVELOPE", "kind_code", "dtype_code", "dtype_of", "op_code", "dtype_name",
    "pack_header", "unpack_header", "pack_envelope", "unpack_envelope", "describe", "describe_mismatch",
    "describe_envelope_mismatch", "COMPARE_ALL", "COMPARE_CALL",
]

MAGIC = 0x4ACC1
#: collective kinds, numbered from 1 in this order on the wire
KINDS = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
         "all_to_all", "barrier", "all_reduce_coalesced")
#: tensor dtypes, numbered from 1 in this order on the wire (99: a dtype not in this table)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
          torch.uint16, torch.uint32, torch.uint64)
_R = dist.ReduceOp.RedOpType
#: reduce ops, numbered from 1 in this order on the wire (0: no op)
OPS = (_R.SUM, _R.AVG, _R.PRODUCT, _R.MIN, _R.MAX, _R.BAND, _R.BOR, _R.BXOR)

#: the header's fields, in wire order (int64 each)
FIELDS = ("magic", "kind", "seq", "dtype", "op", "root", "nbytes", "numel", "extra")
HEADER = struct.Struct("=9q")
HEADER_BYTES = 128  # header area of a slot (HEADER.size, padded)
PAYLOAD_BYTES = 1024  # payload area of a slot: all-reduces up to this size ride in the header exchange
SLOT_BYTES = HEADER_BYTES + PAYLOAD_BYTES
#: how many leading fields ranks must agree on: every field but ``extra`` ...
COMPARE_ALL = 8
#: ... or only magic, kind, seq, dtype (all_to_all: sizes are checked on the byte matrix instead)
COMPARE_CALL = 4

_KIND = {k: i + 1 for i, k in enumerate(KINDS)}
_DTYPE = {d: i + 1 for i, d in enumerate(DTYPES)}
_OP = {o: i + 1 for i, o in enumerate(OPS)}
_UNKNOWN_DTYPE = 99


class Header(NamedTuple):
    """One rank's collective header, unpacked."""

    magic: int
    kind: int
    seq: int
    dtype: int
    op: int
    root: int
    nbytes: int
    numel: int
    extra: int


#: the p2p envelope's fields: magic, dtype code, payload bytes, element count (int64 each)
ENVELOPE = struct.Struct("=4q")


class Envelope(NamedTuple):
    """A p2p message's envelope, unpacked."""

    magic: int
    dtype: int
    nbytes: int
    numel: int


def kind_code(kind: str) -> int:
    """Wire code of a collective kind (KeyError for an unknown name: a programming error)."""
    return _KIND[kind]


def dtype_code(dtype: torch.dtype | None) -> int:
    """Wire code of ``dtype`` (0 for none, 99 for a dtype outside :data:`DTYPES`)."""
    return 0 if dtype is None else _DTYPE.get(dtype, _UNKNOWN_DTYPE)


def dtype_of(code: int) -> torch.dtype | None:
    """The dtype of a wire code, None when the code names no dtype of the table."""
    return DTYPES[code - 1] if 0 < code <= len(DTYPES) else None


def op_code(op: object | None) -> int:
    """Wire code of a ``RedOpType`` (0 for none)."""
    return 0 if op is None else _OP.get(op, 0)


def dtype_name(code: int) -> str:
    """``float32`` for the code of torch.float32; ``dtype#N`` for codes outside the table."""
    d = dtype_of(code)
    return str(d).replace("torch.", "") if d is not None else ("none" if code == 0 else f"dtype#{code}")


def _kind_name(code: int) -> str:
    return KINDS[code - 1] if 0 < code <= len(KINDS) else f"kind#{code}"


def _op_name(code: int) -> str:
    return str(OPS[code - 1]).rsplit(".", 1)[-1] if 0 < code <= len(OPS) else ("none" if code == 0 else
                                                                              f"op#{code}")


def pack_header(buf: bytearray | memoryview, kind: int, seq: int, dtype: int, op: int = 0, root: int = 0,
                nbytes: int = 0, numel: int = 0, extra: int = 0, offset: int = 0) -> None:
    """Write a header (codes, not names: this is on the hot path) at ``offset`` of ``buf``."""
    HEADER.pack_into(buf, offset, MAGIC, kind, seq, dtype, op, root, nbytes, numel, extra)


def unpack_header(buf: bytes | bytearray | memoryview, offset: int = 0) -> Header:
    """Read the header at ``offset`` of ``buf``."""
    return Header(*HEADER.unpack_from(buf, offset))


def pack_envelope(buf: bytearray | memoryview, dtype: int, nbytes: int, numel: int) -> None:
    """Write a p2p envelope at the start of ``buf``."""
    ENVELOPE.pack_into(buf, 0, MAGIC, dtype, nbytes, numel)


def unpack_envelope(buf: bytes | bytearray | memoryview) -> Envelope:
    """Read the p2p envelope at the start of ``buf``."""
    return Envelope(*ENVELOPE.unpack_from(buf, 0))


def _value(field: str, v: int) -> str:
    if field == "kind":
        return _kind_name(v)
    if field == "dtype":
        return dtype_name(v)
    if field == "op":
        return _op_name(v)
    if field == "magic":
        return "valid" if v == MAGIC else f"garbled ({v:#x})"
    return str(v)


def describe(h: Header) -> str:
    """One rank's call in words, e.g. ``all_reduce(float32, 4 elements, SUM) as call #3``."""
    kind = _kind_name(h.kind)
    parts = [dtype_name(h.dtype), f"{h.numel} elements"]
    if h.op:
        parts.append(_op_name(h.op))
    if kind in ("broadcast", "reduce", "gather", "scatter"):
        parts.append(f"root {h.root}")
    return f"{kind}({', '.join(parts)}) as call #{h.seq}"


def _ranks(rs: Sequence[int]) -> str:
    return f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}"


def describe_mismatch(headers: Sequence[Header], compare: int = COMPARE_ALL, group: str = "") -> str:
    """The error text for gathered ``headers`` whose leading ``compare`` fields differ: every
    differing field with each rank's value, then each rank's call in words."""
    fields = []
    for i, name in enumerate(FIELDS[:compare]):
        values: dict[str, list[int]] = {}
        for r, h in enumerate(headers):
            values.setdefault(_value(name, h[i]), []).append(r)
        if len(values) > 1:
            fields.append(f"{name}: " + ", ".join(f"{_ranks(rs)} {v}" for v, rs in values.items()))
    calls: dict[str, list[int]] = {}
    for r, h in enumerate(headers):
        calls.setdefault(describe(h), []).append(r)
    where = f" in group '{group}'" if group else ""
    return (f"accl: ranks disagree on a collective{where}: " + "; ".join(fields or ["(no field differs)"])
            + " (" + "; ".join(f"{_ranks(rs)}: {d}" for d, rs in calls.items()) + ")")


def describe_envelope_mismatch(env: Envelope, peer: int, want_dtype: torch.dtype, want_numel: int,
                               src: str, tag: int) -> str | None:
    """The receiver's error text when ``env`` (from rank ``peer``) does not fit the receive posted
    ``src`` with ``tag``; None when it fits."""
    if env.magic != MAGIC:
        return f"accl: recv {src} tag {tag}: garbled message envelope from rank {peer} (magic {env.magic:#x})"
    want_bytes = want_numel * want_dtype.itemsize
    if env.nbytes == want_bytes and env.dtype == dtype_code(want_dtype):
        return None
    diffs = []
    if env.dtype != dtype_code(want_dtype):
        diffs.append(f"dtype: sent {dtype_name(env.dtype)}, expected {str(want_dtype).replace('torch.', '')}")
    if env.nbytes != want_bytes:
        diffs.append(f"nbytes: sent {env.nbytes}, expected {want_bytes}")
    return (f"accl: recv {src} tag {tag} expects {want_numel} x {want_dtype} ({want_bytes} bytes) but rank "
            f"{peer} sent {env.numel} x {dtype_name(env.dtype)} ({env.nbytes} bytes): " + "; ".join(diffs))
