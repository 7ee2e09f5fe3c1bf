"""The accl wire protocol (header and p2p envelope) without MPI: layout, round trips, error texts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torchhpc.accl import wire

R = dist.ReduceOp.RedOpType


def test_slot_layout_fits_header_and_payload() -> None:
    assert wire.HEADER.size == 9 * 8 <= wire.HEADER_BYTES
    assert wire.ENVELOPE.size <= wire.HEADER_BYTES
    assert wire.SLOT_BYTES == wire.HEADER_BYTES + wire.PAYLOAD_BYTES
    assert wire.HEADER_BYTES % 8 == 0 and wire.PAYLOAD_BYTES % 16 == 0  # int64 words, float64 payloads


def test_header_round_trip_at_an_offset() -> None:
    buf = bytearray(2 * wire.SLOT_BYTES)
    wire.pack_header(buf, wire.kind_code("reduce"), 7, wire.dtype_code(torch.bfloat16), wire.op_code(R.MAX),
                     root=1, nbytes=16, numel=8, extra=3, offset=wire.SLOT_BYTES)
    h = wire.unpack_header(buf, wire.SLOT_BYTES)
    assert h == wire.Header(wire.MAGIC, 3, 7, 4, 5, 1, 16, 8, 3)
    assert wire.unpack_header(buf, 0).magic == 0  # nothing written outside the slot
    assert wire.describe(h) == "reduce(bfloat16, 8 elements, MAX, root 1) as call #7"


def test_codes_cover_every_table_entry_once() -> None:
    assert [wire.kind_code(k) for k in wire.KINDS] == list(range(1, len(wire.KINDS) + 1))
    for d in wire.DTYPES:
        assert wire.dtype_of(wire.dtype_code(d)) is d
    assert wire.dtype_code(None) == 0 and wire.dtype_of(0) is None
    assert wire.dtype_code(torch.float8_e4m3fn) == 99 and wire.dtype_name(99) == "dtype#99"
    assert wire.op_code(None) == 0 and wire.op_code(R.BXOR) == len(wire.OPS)
    with pytest.raises(KeyError):
        wire.kind_code("all_reduce_everything")


def _hdr(**kw: int) -> wire.Header:
    base = dict(magic=wire.MAGIC, kind=1, seq=4, dtype=1, op=1, root=0, nbytes=16, numel=4, extra=0)
    base.update(kw)
    return wire.Header(**base)


def test_mismatch_names_field_ranks_and_values() -> None:
    rows = [_hdr(), _hdr(), _hdr(dtype=2, nbytes=32)]
    msg = wire.describe_mismatch(rows, group="7")
    assert msg.startswith("accl: ranks disagree on a collective in group '7': ")
    assert "dtype: ranks 0,1 float32, rank 2 float64" in msg
    assert "nbytes: ranks 0,1 16, rank 2 32" in msg
    assert "numel" not in msg.split("(")[0]  # numel agrees: not listed as a differing field
    assert "rank 2: all_reduce(float64, 4 elements, SUM) as call #4" in msg


def test_mismatch_of_kind_and_call_order() -> None:
    msg = wire.describe_mismatch([_hdr(), _hdr(kind=2, seq=5, op=0)])
    assert "kind: rank 0 all_reduce, rank 1 broadcast" in msg
    assert "seq: rank 0 4, rank 1 5" in msg
    assert "op: rank 0 SUM, rank 1 none" in msg


def test_mismatch_compares_only_the_leading_fields() -> None:
    rows = [_hdr(nbytes=8), _hdr(nbytes=800)]
    assert "(no field differs)" in wire.describe_mismatch(rows, compare=wire.COMPARE_CALL)
    assert "garbled" in wire.describe_mismatch([_hdr(), _hdr(magic=5)])


def test_envelope_round_trip_and_checks() -> None:
    buf = bytearray(wire.SLOT_BYTES)
    wire.pack_envelope(buf, wire.dtype_code(torch.int32), 12, 3)
    env = wire.unpack_envelope(buf)
    assert env == wire.Envelope(wire.MAGIC, 7, 12, 3)
    assert wire.describe_envelope_mismatch(env, 1, torch.int32, 3, "from 1", 5) is None
    msg = wire.describe_envelope_mismatch(env, 1, torch.int32, 2, "from 1", 5)
    assert msg is not None and "expects 2 x torch.int32 (8 bytes) but rank 1 sent 3 x int32 (12 bytes)" in msg
    assert "nbytes: sent 12, expected 8" in msg
    msg = wire.describe_envelope_mismatch(env, 1, torch.float32, 3, "any source", 5)
    assert msg is not None and "dtype: sent int32, expected float32" in msg
    bad = wire.Envelope(0, 7, 12, 3)
    assert "garbled" in (wire.describe_envelope_mismatch(bad, 0, torch.int32, 3, "from 0", 1) or "")
