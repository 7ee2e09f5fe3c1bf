"""Tensor plumbing of the accl plans: flat views, byte views, segment ranges, host staging."""

from __future__ import annotations

import torch

from .engine import CollectiveEngine

__all__ = ["flat", "as_bytes", "ranges", "stage_in", "stage_out", "host"]


def flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D view of ``t`` (a copy when ``t`` is not contiguous)."""
    return t.contiguous().view(-1) if t.dim() != 1 or not t.is_contiguous() else t


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as a uint8 view (an empty uint8 tensor for an empty ``t``)."""
    return t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def ranges(n: int, per: int) -> list[tuple[int, int]]:
    """[a, b) element ranges of at most ``per`` elements covering ``n`` (one empty range for n == 0)."""
    if n == 0:
        return [(0, 0)]
    return [(a, min(n, a + per)) for a in range(0, n, per)]


def stage_in(t: torch.Tensor, eng: CollectiveEngine, copy: bool = True) -> torch.Tensor:
    """A contiguous 1-D tensor the engine can touch: ``t`` itself when possible, else a host copy
    (``copy=False``: an uninitialised buffer of the same size, for outputs)."""
    if t.is_cpu and t.is_contiguous():  # the hot path: the tensor's own memory
        return t if t.dim() == 1 else t.view(-1)
    if t.device.type != "cpu" and not eng.accepts(t.device):
        host = torch.empty(t.numel(), dtype=t.dtype, pin_memory=torch.cuda.is_available())
        if copy:
            host.copy_(t.reshape(-1))
        return host
    if copy:
        return flat(t)
    return t.view(-1) if t.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype, device=t.device)


def stage_out(buf: torch.Tensor, t: torch.Tensor) -> None:
    """Copy ``buf`` (from :func:`stage_in`) back into ``t`` unless it is ``t``'s own memory."""
    if buf.data_ptr() == t.data_ptr() and buf.is_cpu == t.is_cpu and t.is_contiguous():
        return
    t.copy_(buf.view(t.shape))


def host(t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """A contiguous 1-D CPU tensor with ``t``'s elements: ``t``'s own memory when it is a contiguous CPU
    tensor, else a host copy (``copy=False``: uninitialised, for outputs; deliver with :func:`stage_out`)."""
    if t.is_cpu and t.is_contiguous():
        return t if t.dim() == 1 else t.view(-1)
    h = torch.empty(t.numel(), dtype=t.dtype)
    if copy:
        h.copy_(t.reshape(-1))
    return h
