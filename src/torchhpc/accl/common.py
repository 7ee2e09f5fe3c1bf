"""Wire format of the cross-rank header exchange, dtype/op codes and small helpers shared by the
process-group modules (``process_group``, ``collectives``, ``p2p``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from mpi4py import MPI

from ..errors import MismatchError
from .reduction import RedOp, op_name
from .work import Op

_R = RedOp
_MAGIC = 0x4ACC1
_HDR_WORDS = 16
_SMALL_BYTES = 1024  # all-reduces up to this size ride inside the checking header exchange
_SLOT_WORDS = _HDR_WORDS + _SMALL_BYTES // 8

_KINDS = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
          "all_to_all", "barrier", "all_reduce_coalesced")
_KIND = {k: i + 1 for i, k in enumerate(_KINDS)}
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
           torch.uint16, torch.uint32, torch.uint64)
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}
_OPS = (_R.SUM, _R.AVG, _R.PRODUCT, _R.MIN, _R.MAX, _R.BAND, _R.BOR, _R.BXOR)
_OP_CODE = {o: i + 1 for i, o in enumerate(_OPS)}
# header fields: 0 magic, 1 kind, 2 seq, 3 dtype, 4 op, 5 root, 6 bytes per rank, 7 numel, 8 extra
_F_KIND, _F_SEQ, _F_DTYPE, _F_OP, _F_ROOT, _F_BYTES, _F_NUMEL = 1, 2, 3, 4, 5, 6, 7


AcclMismatchError = MismatchError  # old name of torchhpc.errors.MismatchError, kept importable from here


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(_DTYPES) else f"dtype#{code}"


def _describe(h: Sequence[int]) -> str:
    kind = _KINDS[h[_F_KIND] - 1] if 0 < h[_F_KIND] <= len(_KINDS) else f"op#{h[_F_KIND]}"
    parts = [_dtype_name(h[_F_DTYPE]), f"{h[_F_NUMEL]} elements"]
    if h[_F_OP]:
        parts.append(op_name(_OPS[h[_F_OP] - 1]))
    if kind in ("broadcast", "reduce", "gather", "scatter"):
        parts.append(f"root {h[_F_ROOT]}")
    return f"{kind}({', '.join(parts)}) as call #{h[_F_SEQ]}"


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D view of ``t`` (a copy when ``t`` is not contiguous)."""
    return t.contiguous().view(-1) if t.dim() != 1 or not t.is_contiguous() else t


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _ranges(n: int, per: int) -> list[tuple[int, int]]:
    """[a, b) element ranges of at most ``per`` elements covering ``n`` (one empty range for n == 0)."""
    if n == 0:
        return [(0, 0)]
    return [(a, min(n, a + per)) for a in range(0, n, per)]


class _Tensorish:
    """Checks shared by every entry point."""

    @staticmethod
    def one(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
            raise ValueError(f"accl: {what} takes exactly one tensor per call, got {len(tensors)}")
        t = tensors[0]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"accl: {what} expects a torch.Tensor, got {type(t).__name__}")
        if t.is_sparse:
            raise TypeError(f"accl: {what} does not support sparse tensors")
        return t


def _async(opts: object) -> bool:
    return bool(getattr(opts, "asyncOp", True)) if opts is not None else True


def _mpi_op(op_t: RedOp) -> RedOp:
    """AVG runs as SUM on the engine; the group divides afterwards."""
    return _R.SUM if op_t == _R.AVG else op_t


def _tag_ub() -> int:
    ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    return int(ub) if ub else 32767


def _wrap(exc: BaseException, op: Op) -> BaseException:
    if isinstance(exc, MPI.Exception):
        return dist.DistBackendError(f"accl: MPI error during {op.describe}: {exc.Get_error_string()}")
    return exc




