"""The accl wire protocol (header and p2p envelope) without MPI, as the C++ backend defines it: layout, code tables
against torch's own enumerations, call descriptions and mismatch texts.  Python keeps no copy of it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torchhpc.accl import core

if not hasattr(core.load_backend(), "wire"):
    pytest.skip("accl was built without its test hooks (make env builds them: corebuild --test-hooks)",
                allow_module_level=True)
wire = core.load_backend().wire
R = dist.ReduceOp.RedOpType
OpType = torch._C._distributed_c10d.OpType  # a header's kind is torch's OpType


def _hdr(**kw: int) -> tuple[int, ...]:
    base = dict(magic=wire.MAGIC, kind=int(OpType.ALLREDUCE), seq=4, dtype=1, op=1, root=0, nbytes=16, numel=4,
                extra=0)
    base.update(kw)
    return tuple(base.values())


def test_code_tables_are_torchs_names_in_wire_order() -> None:
    for code, name in enumerate(wire.DTYPES, start=1):  # every name is a torch dtype, coded by its place
        assert wire.dtype_code(getattr(torch, name)) == code
    assert wire.dtype_code(torch.float8_e4m3fn) == 99  # outside the table
    ops = [o.name for o in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR)]
    assert list(wire.OPS) == ops  # RedOpType's order, so that codes are RedOpType + 1
    assert [wire.op_code(o) for o in ops] == [int(getattr(R, o)) + 1 for o in ops]
    assert wire.op_code("PREMUL_SUM") == 0


def test_describe_a_call() -> None:
    h = _hdr(kind=int(OpType.REDUCE), seq=7, dtype=wire.dtype_code(torch.bfloat16),
             op=wire.op_code("MAX"), root=1, numel=8, extra=3)
    assert wire.describe(h) == "reduce(bfloat16, 8 elements, MAX, root 1) as call #7"
    assert wire.describe(_hdr(kind=42, dtype=99, op=0)) == "kind#42(dtype#99, 4 elements) as call #4"


def test_mismatch_names_field_ranks_and_values() -> None:
    rows = [_hdr(), _hdr(), _hdr(dtype=2, nbytes=32)]
    msg = wire.describe_mismatch(rows, group="7")
    assert msg.startswith("accl: ranks disagree on a collective in group '7': ")
    assert "dtype: ranks 0,1 float32, rank 2 float64" in msg
    assert "nbytes: ranks 0,1 16, rank 2 32" in msg
    assert "numel" not in msg.split("(")[0]  # numel agrees: not listed as a differing field
    assert "rank 2: all_reduce(float64, 4 elements, SUM) as call #4" in msg


def test_mismatch_of_kind_and_call_order() -> None:
    msg = wire.describe_mismatch([_hdr(), _hdr(kind=int(OpType.BROADCAST), seq=5, op=0)])
    assert "kind: rank 0 all_reduce, rank 1 broadcast" in msg
    assert "seq: rank 0 4, rank 1 5" in msg
    assert "op: rank 0 SUM, rank 1 none" in msg


def test_mismatch_compares_only_the_leading_fields() -> None:
    rows = [_hdr(nbytes=8), _hdr(nbytes=800)]
    text = wire.describe_mismatch(rows, compare=wire.COMPARE_CALL)
    assert "no field differs: a message between ranks was garbled" in text
    assert "garbled" in wire.describe_mismatch([_hdr(), _hdr(magic=5)])


def test_envelope_checks() -> None:
    env = (wire.MAGIC, wire.dtype_code(torch.int32), 12, 3)
    assert wire.envelope_mismatch(env, 1, torch.empty(3, dtype=torch.int32), "from rank 1", 5) == ""
    msg = wire.envelope_mismatch(env, 1, torch.empty(2, dtype=torch.int32), "from rank 1", 5)
    assert msg.startswith("accl: recv from rank 1 tag 5 expects 2 x torch.int32 (8 bytes) but rank 1 sent 3 x int32 "
                          "(12 bytes)")
    assert "nbytes: sent 12, expected 8" in msg
    msg = wire.envelope_mismatch(env, 1, torch.empty(3), "from any source", 5)
    assert "dtype: sent int32, expected float32" in msg and "nbytes" not in msg
    assert "garbled" in wire.envelope_mismatch((0, 7, 12, 3), 0, torch.empty(3, dtype=torch.int32), "from rank 0", 1)


# (dtype code, nbytes, numel) sent for 3 x int32: one field off, a negative size, an unknown dtype, a huge pair
GARBLED = [(None, 12, 4), (None, 12, -3), (77, 12, 3), (None, -12, -3), (None, 1 << 62, 1 << 60)]


@pytest.mark.parametrize(("dtype", "nbytes", "numel"), GARBLED)
def test_an_inconsistent_envelope_is_garbled_before_any_size_is_used(dtype: int | None, nbytes: int,
                                                                     numel: int) -> None:
    """A receiver trusts an envelope's sizes only when they agree with each other (a known dtype, numel x its size
    = nbytes, neither negative): one corrupted field is refused as garbled, never drained or received into."""
    sent = (wire.MAGIC, wire.dtype_code(torch.int32) if dtype is None else dtype, nbytes, numel)
    msg = wire.envelope_mismatch(sent, 2, torch.empty(3, dtype=torch.int32), "from rank 2", 9)
    assert "garbled message envelope from rank 2 (magic valid" in msg, msg
