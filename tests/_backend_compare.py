"""Run one workload on gloo and then on accl in the same MPI job, and compare what each produced.

Each run gets its own default process group (``init_process_group`` ... ``destroy_process_group``),
so torch's own code (DeviceMesh, FSDP2, DDP, DCP, ...) picks the backend up exactly as a user's
script would.  Comparison is bitwise where both backends reduce in the same order (data movement,
and sums of two terms, which IEEE addition makes order-free), else to float tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import torchhpc.accl  # noqa: F401  (registers "accl"; its env:// rendezvous also serves gloo under mpiexec)

BACKENDS = ("gloo", "accl")
GROUP_TIMEOUT = timedelta(seconds=60)


def run_on(backend: str, workload: Callable[[], Any]) -> Any:
    """Run ``workload()`` with a fresh default group of ``backend``; always tear the group down."""
    dist.init_process_group(backend, timeout=GROUP_TIMEOUT)
    try:
        result = workload()
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def run_both(workload: Callable[[], Any]) -> dict[str, Any]:
    """``{backend: workload()}`` for gloo and accl, run one after the other in this job."""
    return {backend: run_on(backend, workload) for backend in BACKENDS}


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in _flatten(value[k])]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [value]


def assert_same(got: Any, want: Any, *, bitwise: bool, rtol: float = 1e-10, atol: float = 1e-12,
                what: str = "") -> None:
    """Every tensor in ``got`` equals the one in ``want``: bit for bit, or within rtol/atol."""
    g, w = _flatten(got), _flatten(want)
    assert len(g) == len(w), f"{what}: {len(g)} values vs {len(w)}"
    for i, (a, b) in enumerate(zip(g, w, strict=True)):
        if not isinstance(a, torch.Tensor):
            assert a == b, f"{what}[{i}]: {a!r} != {b!r}"
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]: {a.dtype}{tuple(a.shape)} vs " \
                                                          f"{b.dtype}{tuple(b.shape)}"
        if bitwise:
            assert torch.equal(a, b), f"{what}[{i}]: not bitwise equal, max diff {(a - b).abs().max()}"
        else:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, i=i: f"{what}[{i}]: {m}")


def compare_backends(results: dict[str, Any], *, bitwise: bool, rtol: float = 1e-10, atol: float = 1e-12,
                     what: str = "") -> None:
    """accl's result equals gloo's (see :func:`assert_same`)."""
    assert_same(results["accl"], results["gloo"], bitwise=bitwise, rtol=rtol, atol=atol,
                what=what or "accl vs gloo")


def detached(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Plain CPU copies (DTensors gathered to their full value)."""
    out = []
    for t in tensors:
        t = t.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out.append(t.clone())
    return out
