"""The calls ``torchhpc bench`` times: one float32 collective per implementation (accl, PyTorch's own MPI
backend, gloo, the raw mpi4py call on torch's or numpy's memory), and the process groups they run on.  Every
implementation on torch's memory works on the same tensors, so that no one of them gets luckier pages (huge or
not, first touched where) than another; ``mpi4py-numpy`` has numpy's arrays."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["shape", "measured_bytes", "runners", "setup_groups", "settle", "teardown"]


def shape(coll: str, nbytes: int, n: int) -> tuple[int, int]:
    """(input, output) float32 element counts of one ``coll`` of ``nbytes`` at ``n`` ranks: all_gather's size is
    its output buffer, reduce_scatter's and all_to_all's their input buffer, a multiple of ``n`` elements."""
    numel = max(1, nbytes // 4)
    per = max(1, numel // n)
    return {"allreduce": (numel, 0), "broadcast": (numel, 0), "allgather": (per, per * n),
            "reduce_scatter": (per * n, per), "alltoall": (per * n, per * n)}[coll]


def measured_bytes(coll: str, nbytes: int, n: int) -> int:
    """The bytes a ``coll`` of ``nbytes`` really moves per rank's buffer (more than ``nbytes`` where fewer than
    one float32 per rank: 8 B at 4 ranks is 16 B for all_gather, reduce_scatter and all_to_all)."""
    n_in, n_out = shape(coll, nbytes, n)
    return 4 * (n_out if coll == "allgather" else n_in)


def _torch_buffers(n_in: int, n_out: int) -> tuple:
    """The (input, output) float32 tensors every implementation on torch's memory shares, and their numpy views
    for the raw call (checked to share the tensors' storage)."""
    import torch

    ins, outs = torch.ones(n_in, dtype=torch.float32), torch.zeros(n_out, dtype=torch.float32)
    a, b = ins.numpy(), outs.numpy()
    for t, view in ((ins, a), (outs, b)):
        if t.numel() and view.ctypes.data != t.data_ptr():
            raise RuntimeError("torchhpc bench: tensor.numpy() did not share the tensor's memory")
    return ins, outs, a, b


def runners(coll: str, nbytes: int, n: int, groups: dict, comm, impls: list[str]) -> dict[str, Callable[[], None]]:
    """One callable per implementation in ``impls`` doing one ``coll`` of ``nbytes`` (float32): those on torch's
    memory on one shared pair of tensors, ``mpi4py-numpy`` on numpy's arrays."""
    import numpy as np
    import torch.distributed as dist
    from mpi4py import MPI

    out: dict[str, Callable[[], None]] = {}
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch >= 2.13 name
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    n_in, n_out = shape(coll, nbytes, n)
    ins, outs, a, b = _torch_buffers(n_in, n_out)
    for impl in impls:
        if impl in ("mpi4py", "mpi4py-numpy"):
            raw_a, raw_b = (a, b) if impl == "mpi4py" else (np.ones(n_in, np.float32), np.zeros(n_out, np.float32))
            out[impl] = {"allreduce": lambda a=raw_a: comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM),
                         "broadcast": lambda a=raw_a: comm.Bcast(a, 0),
                         "allgather": lambda a=raw_a, b=raw_b: comm.Allgather(a, b),
                         "reduce_scatter": lambda a=raw_a, b=raw_b: comm.Reduce_scatter_block(a, b, MPI.SUM),
                         "alltoall": lambda a=raw_a, b=raw_b: comm.Alltoall(a, b)}[coll]
            continue
        g = groups[impl]
        out[impl] = {"allreduce": lambda t=ins, g=g: dist.all_reduce(t, group=g),
                     "broadcast": lambda t=ins, g=g: dist.broadcast(t, 0, group=g),
                     "allgather": lambda i=ins, o=outs, g=g: all_gather(o, i, group=g),
                     "reduce_scatter": lambda i=ins, o=outs, g=g: reduce_scatter(o, i, group=g),
                     "alltoall": lambda i=ins, o=outs, g=g: dist.all_to_all_single(o, i, group=g)}[coll]
    return out


def _upstream_unavailable(comm) -> str | None:
    """Why ``mpi-upstream`` cannot run on some rank (the same answer on every rank), or None."""
    why = None
    try:
        import torchhpc.mpi_upstream as upstream

        upstream.load()
    except Exception as exc:  # ImportError when not built; OSError/RuntimeError from a broken build
        why = f"{type(exc).__name__}: {exc}"
    return next((w for w in comm.allgather(why) if w), None)


def setup_groups(comm, impls: list[str], say: Callable[..., None]) -> tuple[dict, dict[str, str]]:
    """The process group of every implementation in ``impls`` (accl's is the default group) and the ones
    skipped with their reason: ``mpi-upstream`` is dropped from ``impls`` where its module cannot load."""
    import torch.distributed as dist

    skipped: dict[str, str] = {}
    groups = {"accl": dist.group.WORLD}  # (every rank parses the same --impls: the groups match)
    if "mpi-upstream" in impls:
        why = _upstream_unavailable(comm)
        if why is None:
            import torchhpc.mpi_upstream as upstream

            groups["mpi-upstream"] = dist.new_group(backend=upstream.NAME)
        else:
            skipped["mpi-upstream"] = why
            impls.remove("mpi-upstream")
            say("torchhpc bench: not timing mpi-upstream, PyTorch's own MPI backend: it is not built in this "
                f"environment (`make mpi-backend` builds it; `--impls` chooses what is timed). {why}", flush=True)
    if "gloo" in impls:
        groups["gloo"] = dist.new_group(backend="gloo")
    return groups, skipped


def settle(groups: dict) -> None:
    """Wait until upstream's worker thread has dropped the Work of every call made so far: it destroys a Work
    after completing it, and the last reference to a tensor dropped there takes the GIL from that thread.  Its
    barrier is queued behind them and holds no tensor."""
    import torch.distributed as dist

    if "mpi-upstream" in groups:
        dist.barrier(group=groups["mpi-upstream"])


def teardown(groups: dict, comm) -> None:
    """Destroy every group, the extra ones first, and free ``comm``: upstream's worker thread is joined (its
    group destroyed) before the interpreter finalizes, as a thread taking the GIL during finalization aborts
    the process."""
    import torch.distributed as dist

    for impl in [i for i in groups if i != "accl"]:
        dist.destroy_process_group(groups.pop(impl))
    dist.destroy_process_group()
    comm.Free()
