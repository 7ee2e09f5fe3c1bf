"""Point-to-point operations of :class:`~.process_group.ProcessGroupACCL` (a mixin).

Each message is a header (kind, dtype, size) on one MPI matching space, followed, when larger than
a header slot, by payload segments on a second one, posted only once the header arrived: a size
or dtype mismatch is reported on the receiver and the bad payload is drained into scratch memory,
so it can never be matched by a later receive."""

from __future__ import annotations

import torch

from .common import (
    _DTYPE_CODE,
    _DTYPES,
    _HDR_WORDS,
    _MAGIC,
    _SLOT_WORDS,
    _SMALL_BYTES,
    AcclMismatchError,
    _as_bytes,
    _dtype_name,
    _ranges,
    _Tensorish,
)
from .engine import Request
from .work import AcclWork


class PointToPointMixin:
    """send/recv/recv_anysource and monitored_barrier."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> AcclWork:
        t = _Tensorish.one(tensors, "send")
        self._check_peer(dst, "send", "dst")
        self._check_tag(tag)
        eng = self._engine_for("send", t.dtype)
        op = self._new_op("send", [t], p2p=True)
        esz, numel = t.element_size(), t.numel()
        nbytes = numel * esz
        op.describe = lambda: f"send({t.dtype}, {numel} elements, to {dst}, tag {tag})"
        hdr = torch.zeros(_SLOT_WORDS, dtype=torch.int64)
        hdr[:6] = torch.tensor([_MAGIC, 1, _DTYPE_CODE.get(t.dtype, 99), nbytes, numel, 0])

        def stage0() -> list[Request]:
            flat = self._stage_in(t, eng)
            if nbytes <= _SMALL_BYTES:  # header and payload in one message
                if nbytes:
                    hdr[_HDR_WORDS:].view(torch.uint8)[:nbytes] = _as_bytes(flat)
                return [self._call(self._mpi, "send", nbytes, hdr, dst, tag, 0)]
            reqs = [self._call(self._mpi, "send", 0, hdr, dst, tag, 0)]
            per = self._per(esz)
            reqs += [self._call(eng, "send", (b - a) * esz, flat[a:b], dst, tag, 1)
                     for a, b in _ranges(numel, per) if b > a]
            state_keep.append(flat)
            return reqs

        state_keep: list[torch.Tensor] = []
        op.stages = [stage0]
        return self._submit(op, True)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> AcclWork:
        t = _Tensorish.one(tensors, "recv")
        self._check_peer(src, "recv", "src")
        return self._recv(t, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> AcclWork:
        t = _Tensorish.one(tensors, "recv")
        return self._recv(t, -1, tag)

    def _recv(self, t: torch.Tensor, src: int, tag: int) -> AcclWork:
        self._check_tag(tag)
        eng = self._engine_for("recv", t.dtype)
        op = self._new_op("recv", [t], p2p=True)
        esz, numel = t.element_size(), t.numel()
        nbytes = numel * esz
        frm = "any source" if src < 0 else f"from {src}"
        op.describe = lambda: f"recv({t.dtype}, {numel} elements, {frm}, tag {tag})"
        hdr = torch.zeros(_SLOT_WORDS, dtype=torch.int64)
        state: dict = {}

        def stage_header() -> list[Request]:
            req = self._call(self._mpi, "recv", 0, hdr, src, tag, 0)
            state["hreq"] = req
            return [req]

        def stage_payload() -> list[Request]:
            peer = state["hreq"].source()
            op.source_rank = peer
            magic, _, dcode, sbytes, snumel = hdr[:5].tolist()
            if magic != _MAGIC:
                raise AcclMismatchError(f"accl: recv from rank {peer} tag {tag}: garbled message header")
            mismatch = None
            if sbytes != nbytes or dcode != _DTYPE_CODE.get(t.dtype, 99):
                mismatch = (f"accl: recv {frm} tag {tag} expects {numel} x {t.dtype} ({nbytes} bytes) "
                            f"but rank {peer} sent {snumel} x {_dtype_name(dcode)} ({sbytes} bytes)")
            state["mismatch"] = mismatch
            if sbytes <= _SMALL_BYTES:
                state["small"] = sbytes
                return []
            # receive the sender's segments, in the sender's dtype, on the engine the sender used
            # (into a scratch buffer on mismatch, so that nothing of the bad message is lost or leaks)
            sdtype = _DTYPES[dcode - 1] if 0 < dcode <= len(_DTYPES) else torch.uint8
            if mismatch:
                dst = torch.empty(sbytes // sdtype.itemsize if sdtype.itemsize else sbytes, dtype=sdtype)
                peng = self._engine_for("send", sdtype)
            else:
                dst = self._stage_in(t, eng, copy=False)
                peng = eng
            state["dst"] = dst
            per = self._per(dst.element_size())
            return [self._call(peng, "recv", (b - a) * dst.element_size(), dst[a:b], peer, tag, 1)
                    for a, b in _ranges(dst.numel(), per) if b > a]

        def finish() -> None:
            if state["mismatch"]:
                raise AcclMismatchError(state["mismatch"])
            if "small" in state:
                if nbytes:
                    flat = torch.empty(numel, dtype=t.dtype)
                    _as_bytes(flat).copy_(hdr[_HDR_WORDS:].view(torch.uint8)[:nbytes])
                    t.copy_(flat.view(t.shape))
                return
            self._stage_out(state["dst"], t)

        op.stages, op.finish = [stage_header, stage_payload], finish
        return self._submit(op, True)

