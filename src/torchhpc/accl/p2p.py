"""Point-to-point plans: ``send`` and ``recv`` over the :mod:`.wire` envelope.

Each message is an envelope slot (dtype, size and, up to ``wire.PAYLOAD_BYTES``, the payload) on the
header channel, followed, when larger, by payload segments on the payload channel, posted by the
receiver only once the envelope arrived: a size or dtype mismatch is reported on the receiver and
the bad payload is drained into scratch memory, so it can never be matched by a later receive."""

from __future__ import annotations

import torch

from ..errors import MismatchError
from . import wire
from .engine import CollectiveEngine, Mode, Request
from .plans import Context, Plan
from .tensors import as_bytes, ranges, stage_in, stage_out

__all__ = ["Send", "Recv"]

_PAYLOAD = wire.HEADER_BYTES


def _slot() -> torch.Tensor:
    return torch.zeros(wire.SLOT_BYTES, dtype=torch.uint8)


class Send(Plan):
    """send ``t`` to ``dst`` with ``tag``."""

    kind = "send"

    def __init__(self, ctx: Context, eng: CollectiveEngine, t: torch.Tensor, dst: int, tag: int) -> None:
        super().__init__(ctx, eng, False, False, [t])
        self.t, self.dst, self.tag = t, dst, tag
        self.numel, self.esz = t.numel(), t.element_size()
        self.env = _slot()
        wire.pack_envelope(self.env.numpy().data, wire.dtype_code(t.dtype), self.numel * self.esz, self.numel)
        self.keep: torch.Tensor | None = None

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if k:
            return None
        buf = stage_in(self.t, self.eng)
        nbytes = self.numel * self.esz
        if nbytes <= wire.PAYLOAD_BYTES:  # envelope and payload in one message
            if nbytes:
                self.env[_PAYLOAD: _PAYLOAD + nbytes] = as_bytes(buf)
            return [ctx.call(ctx.mpi, "send", nbytes, None, self.env, self.dst, self.tag, 0)]
        self.keep = buf
        reqs = [ctx.call(ctx.mpi, "send", 0, None, self.env, self.dst, self.tag, 0)]
        reqs += [ctx.call(self.eng, "send", (b - a) * self.esz, None, buf[a:b], self.dst, self.tag, 1)
                 for a, b in ranges(self.numel, ctx.per(self.esz)) if b > a]
        return reqs

    def describe(self, seq: int) -> str:
        return f"send({self.t.dtype}, {self.numel} elements, to {self.dst}, tag {self.tag})"


class Recv(Plan):
    """recv into ``t`` from ``src`` (-1: any source) with ``tag``."""

    kind = "recv"

    def __init__(self, ctx: Context, eng: CollectiveEngine, t: torch.Tensor, src: int, tag: int,
                 engine_for: object) -> None:
        super().__init__(ctx, eng, False, False, [t])
        self.t, self.src, self.tag = t, src, tag
        self.numel = t.numel()
        self.env = _slot()
        self.engine_for = engine_for
        self.hreq: Request | None = None
        self.mismatch: str | None = None
        self.small = -1
        self.dst: torch.Tensor | None = None

    @property
    def frm(self) -> str:
        return "any source" if self.src < 0 else f"from {self.src}"

    def stage(self, k: int, ctx: Context, mode: Mode) -> list[Request] | None:
        if k == 0:
            self.hreq = ctx.call(ctx.mpi, "recv", 0, None, self.env, self.src, self.tag, 0)
            return [self.hreq]
        if k > 1:
            return None
        peer = self.hreq.source()  # type: ignore[union-attr]
        self.source_rank = peer
        env = wire.unpack_envelope(self.env.numpy().data)
        if env.magic != wire.MAGIC:
            raise MismatchError(wire.describe_envelope_mismatch(env, peer, self.t.dtype, self.numel, self.frm,
                                                                self.tag))
        self.mismatch = wire.describe_envelope_mismatch(env, peer, self.t.dtype, self.numel, self.frm, self.tag)
        if env.nbytes <= wire.PAYLOAD_BYTES:
            self.small = env.nbytes
            return []
        # receive the sender's segments, in the sender's dtype, on the engine the sender used
        # (into a scratch buffer on mismatch, so that nothing of the bad message is lost or leaks)
        sdtype = wire.dtype_of(env.dtype) or torch.uint8
        if self.mismatch:
            dst = torch.empty(env.nbytes // sdtype.itemsize if sdtype.itemsize else env.nbytes, dtype=sdtype)
            peng = self.engine_for("send", sdtype)  # type: ignore[operator]
        else:
            dst = stage_in(self.t, self.eng, copy=False)
            peng = self.eng
        self.dst = dst
        esz = dst.element_size()
        return [ctx.call(peng, "recv", (b - a) * esz, None, dst[a:b], peer, self.tag, 1)
                for a, b in ranges(dst.numel(), ctx.per(esz)) if b > a]

    def finish(self) -> None:
        if self.mismatch:
            raise MismatchError(self.mismatch)
        t = self.t
        if self.small >= 0:
            nbytes = self.small
            if nbytes:
                buf = torch.empty(self.numel, dtype=t.dtype)
                as_bytes(buf).copy_(self.env[_PAYLOAD: _PAYLOAD + nbytes])
                t.copy_(buf.view(t.shape))
            return
        stage_out(self.dst, t)  # type: ignore[arg-type]

    def describe(self, seq: int) -> str:
        return f"recv({self.t.dtype}, {self.numel} elements, {self.frm}, tag {self.tag})"
