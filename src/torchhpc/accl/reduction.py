"""Which (dtype, reduce op) pairs the backend supports, and how MPI carries each of them out.

- float32/float64 and the fixed-width integers map to MPI's predefined types and ops.
- bool is carried as one byte per element (torch stores 0/1) with gloo's semantics:
  SUM and MAX and BOR are logical OR, PRODUCT and MIN and BAND are logical AND, BXOR is XOR.
- float16 and bfloat16 have no MPI datatype: they travel as 16-bit words and are reduced by an
  MPI user-defined op that calls torch's own kernels on the two operands, in the tensor's own
  precision (as gloo does), so nothing is widened on the wire.
- AVG is a SUM followed by a division by the group size, for floating types only (integer and
  bool AVG raise, as with gloo).  BAND/BOR/BXOR are for integer and bool types only.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from mpi4py import MPI

__all__ = ["RedOp", "red_op_of", "check_reduction", "mpi_reduction", "REDUCIBLE_DTYPES", "op_name"]

RedOp = dist.ReduceOp.RedOpType
_R = RedOp

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
REDUCIBLE_DTYPES = FLOAT_DTYPES + INT_DTYPES + (torch.bool,)
_BITWISE = (_R.BAND, _R.BOR, _R.BXOR)
_SUPPORTED_OPS = (_R.SUM, _R.AVG, _R.PRODUCT, _R.MIN, _R.MAX, _R.BAND, _R.BOR, _R.BXOR)

_MPI_TYPE = {
    torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
    torch.int8: MPI.INT8_T, torch.int16: MPI.INT16_T, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T,
    torch.uint8: MPI.UINT8_T, torch.bool: MPI.UINT8_T,
    torch.float16: MPI.UINT16_T, torch.bfloat16: MPI.UINT16_T,
}
_MPI_OP = {_R.SUM: MPI.SUM, _R.AVG: MPI.SUM, _R.PRODUCT: MPI.PROD, _R.MIN: MPI.MIN, _R.MAX: MPI.MAX,
           _R.BAND: MPI.BAND, _R.BOR: MPI.BOR, _R.BXOR: MPI.BXOR}
# bool as 0/1 bytes: OR is MAX, AND is MIN (gloo semantics).
_MPI_BOOL_OP = {_R.SUM: MPI.MAX, _R.PRODUCT: MPI.MIN, _R.MIN: MPI.MIN, _R.MAX: MPI.MAX,
                _R.BAND: MPI.BAND, _R.BOR: MPI.BOR, _R.BXOR: MPI.BXOR}


def op_name(op: RedOp) -> str:
    """``"SUM"`` for ``RedOpType.SUM``: for error messages."""
    return str(op).rsplit(".", 1)[-1]


def red_op_of(op: object) -> RedOp:
    """The ``RedOpType`` inside whatever torch handed us (``ReduceOp``, ``RedOpType`` or options' op)."""
    if isinstance(op, RedOp):
        return op
    inner = getattr(op, "op", None)
    if isinstance(inner, RedOp):
        return inner
    if isinstance(op, dist.ReduceOp):  # ReduceOp wraps a RedOpType; compare by value
        for cand in _SUPPORTED_OPS + (_R.PREMUL_SUM, _R.UNUSED):
            if op == cand:
                return cand
    raise TypeError(f"accl: unrecognised reduce op {op!r}")


_VALID: set[tuple[torch.dtype, RedOp]] = set()


def check_reduction(dtype: torch.dtype, op: RedOp, what: str) -> None:
    """Raise a clear error when ``op`` is not defined for ``dtype`` (same rules as gloo)."""
    if (dtype, op) in _VALID:
        return
    _check_reduction(dtype, op, what)
    _VALID.add((dtype, op))


def _check_reduction(dtype: torch.dtype, op: RedOp, what: str) -> None:
    if op not in _SUPPORTED_OPS:
        raise ValueError(f"accl: {what} does not support ReduceOp.{op_name(op)} "
                         f"(supported: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR)")
    if dtype not in REDUCIBLE_DTYPES:
        raise TypeError(f"accl: {what} cannot reduce dtype {dtype}; supported: "
                        + ", ".join(str(d).replace("torch.", "") for d in REDUCIBLE_DTYPES))
    if op in _BITWISE and dtype in FLOAT_DTYPES:
        raise TypeError(f"accl: {what}: ReduceOp.{op_name(op)} is only defined for integer and bool "
                        f"tensors, got {dtype}")
    if op == _R.AVG and dtype not in FLOAT_DTYPES:
        raise TypeError(f"accl: {what}: ReduceOp.AVG needs a floating-point tensor (the average of "
                        f"{dtype} values is not a {dtype}); got {dtype}")


def _half_kernel(op: RedOp):
    """torch's in-place kernel for ``op`` on two operands of the tensor's own (16-bit) dtype."""
    if op in (_R.SUM, _R.AVG):
        return lambda acc, x: acc.add_(x)
    if op == _R.PRODUCT:
        return lambda acc, x: acc.mul_(x)
    if op == _R.MIN:
        return lambda acc, x: torch.minimum(acc, x, out=acc)
    return lambda acc, x: torch.maximum(acc, x, out=acc)


@functools.cache
def _half_op(dtype: torch.dtype, op: RedOp) -> MPI.Op:
    kernel = _half_kernel(op)

    def reduce_fn(inbuf, inoutbuf, datatype) -> None:  # MPI semantics: inoutbuf = inbuf op inoutbuf
        if len(inbuf) == 0:  # noqa: SIM102  (frombuffer rejects empty buffers)
            return
        x = torch.frombuffer(inbuf, dtype=dtype)
        acc = torch.frombuffer(inoutbuf, dtype=dtype)
        kernel(acc, x)

    return MPI.Op.Create(reduce_fn, commute=True)


_MPI_REDUCTION: dict[tuple[torch.dtype, int], tuple[MPI.Datatype, MPI.Op]] = {}


def mpi_reduction(dtype: torch.dtype, op: RedOp) -> tuple[MPI.Datatype, MPI.Op]:
    """The MPI datatype and op that carry out ``op`` on ``dtype`` (after :func:`check_reduction`)."""
    key = (dtype, op.value)  # the enum's int: hashing the enum object costs several times more
    found = _MPI_REDUCTION.get(key)
    if found is not None:
        return found
    if dtype in (torch.float16, torch.bfloat16):
        found = MPI.UINT16_T, _half_op(dtype, op)
    elif dtype == torch.bool:
        found = MPI.UINT8_T, _MPI_BOOL_OP[op]
    else:
        found = _MPI_TYPE[dtype], _MPI_OP[op]
    _MPI_REDUCTION[key] = found
    return found
