#!/usr/bin/env python
"""One rank of a job on PyTorch's own MPI backend built by ``make mpi-backend`` (``torchhpc.mpi_upstream``).

    mpiexec -n 4 python tests/mpi_upstream_job.py --mode plugin|mpi4py-first|torch-mpi

``plugin``: ``"mpi_upstream"`` with nothing else touching MPI (upstream's code calls ``MPI_Init_thread``);
``mpi4py-first``: mpi4py initializes MPI before the backend is created; ``torch-mpi``: torch's own name
``"mpi"`` filled by this build (``use_as_torch_mpi``).  Each rank checks all_reduce (SUM, MAX, PRODUCT,
MIN), broadcast, all_gather (list and into-tensor), reduce_scatter, all_to_all, gather, scatter, a send/recv
ring, async work, barrier, a group of every rank and the refusal of a strict subset, against values it
computes itself, and prints one ``OK`` line.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def expect(cond: bool, what: str) -> None:
    """Raise naming ``what`` unless ``cond``."""
    if not cond:
        raise AssertionError(what)


def collectives(rank: int, size: int) -> None:
    """Each collective against the value every rank computes independently."""
    total = size * (size + 1) / 2
    for dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
        t = torch.full((5,), rank + 1, dtype=dtype)
        dist.all_reduce(t)
        expect(torch.equal(t, torch.full((5,), total, dtype=dtype)), f"all_reduce SUM {dtype}: {t}")
    for op, want in ((dist.ReduceOp.MAX, size), (dist.ReduceOp.MIN, 1), (dist.ReduceOp.PRODUCT,
                                                                          float(torch.arange(1, size + 1).prod()))):
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, op=op)
        expect(torch.equal(t, torch.full((3,), want)), f"all_reduce {op}: {t}")
    root = size - 1
    b = torch.arange(7, dtype=torch.float64) * (rank + 1)
    dist.broadcast(b, src=root)
    expect(torch.equal(b, torch.arange(7, dtype=torch.float64) * size), f"broadcast: {b}")
    outs = [torch.zeros(2) for _ in range(size)]
    dist.all_gather(outs, torch.full((2,), float(rank)))
    expect(all(torch.equal(o, torch.full((2,), float(i))) for i, o in enumerate(outs)), f"all_gather: {outs}")
    flat = torch.zeros(size * 2)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(flat, torch.full((2,), float(rank)))
    expect(torch.equal(flat, torch.arange(size).float().repeat_interleave(2)), f"all_gather_into_tensor: {flat}")
    rs = torch.zeros(2)
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    reduce_scatter(rs, torch.arange(size * 2, dtype=torch.float32) + rank)
    want_rs = size * (torch.arange(2, dtype=torch.float32) + 2 * rank) + total - size
    expect(torch.equal(rs, want_rs), f"reduce_scatter_tensor: {rs} != {want_rs}")
    a2a = torch.zeros(size)
    dist.all_to_all_single(a2a, torch.arange(size, dtype=torch.float32) + 10 * rank)
    expect(torch.equal(a2a, torch.arange(size, dtype=torch.float32) * 10 + rank), f"all_to_all_single: {a2a}")
    gathered = [torch.zeros(1) for _ in range(size)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank)]), gathered, dst=0)
    if rank == 0:
        expect([float(g) for g in gathered] == [float(i) for i in range(size)], f"gather: {gathered}")
    piece = torch.zeros(1)
    dist.scatter(piece, [torch.tensor([float(10 + i)]) for i in range(size)] if rank == 0 else None, src=0)
    expect(float(piece) == 10 + rank, f"scatter: {piece}")


def point_to_point(rank: int, size: int) -> None:
    """A ring of isend/recv and an async all_reduce waited on."""
    out = dist.isend(torch.full((4,), float(rank)), dst=(rank + 1) % size)
    got = torch.zeros(4)
    dist.recv(got, src=(rank - 1) % size)
    out.wait()
    expect(torch.equal(got, torch.full((4,), float((rank - 1) % size))), f"send/recv ring: {got}")
    work = dist.all_reduce(torch.ones(1000), async_op=True)
    work.wait()
    expect(work.is_completed(), "async all_reduce not completed after wait()")
    dist.barrier()


def groups(rank: int, size: int, mpi_upstream) -> None:
    """A group of every rank works; a strict subset is refused on its members (no hang)."""
    everyone = dist.new_group(list(range(size)))
    t = torch.ones(3)
    dist.all_reduce(t, group=everyone)
    expect(torch.equal(t, torch.full((3,), float(size))), f"all_reduce on new_group(all): {t}")
    members = list(range(size - 1))
    try:
        sub = dist.new_group(members)
    except mpi_upstream.UnsupportedGroupError as exc:
        expect(rank in members and "strict subset" in str(exc), f"unexpected refusal on rank {rank}: {exc}")
    else:
        expect(rank not in members and sub == dist.GroupMember.NON_GROUP_MEMBER, f"subset group made on {rank}")
    dist.barrier()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("plugin", "mpi4py-first", "torch-mpi"), required=True)
    args = ap.parse_args()
    if args.mode == "mpi4py-first":
        from mpi4py import MPI

        expect(MPI.Is_initialized(), "mpi4py did not initialize MPI")
    import torchhpc.mpi_upstream as mpi_upstream

    mod = mpi_upstream.load()
    expect(mod.initialized() == (args.mode == "mpi4py-first"), f"MPI initialized before the backend: "
                                                                f"{mod.initialized()} ({args.mode})")
    if args.mode == "torch-mpi":
        mpi_upstream.use_as_torch_mpi()
        expect(dist.is_mpi_available(), "dist.is_mpi_available() is False after use_as_torch_mpi()")
        dist.init_process_group("mpi")
        expect(dist.get_backend() == "mpi", f"backend {dist.get_backend()}")
    else:
        mpi_upstream.init_process_group()
        expect(dist.get_backend() == "mpi_upstream", f"backend {dist.get_backend()}")
    rank, size = dist.get_rank(), dist.get_world_size()
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if var in os.environ:
            expect(int(os.environ[var]) == size, f"{var}={os.environ[var]} but world size {size}")
    collectives(rank, size)
    point_to_point(rank, size)
    if args.mode != "torch-mpi":  # torch's MPI path would call the backend on members only: refused the same
        groups(rank, size, mpi_upstream)
    cuda = mpi_upstream.cuda_aware()
    dist.destroy_process_group()
    print(f"OK rank {rank}/{size} mode={args.mode} module={mod.module} cuda_aware={cuda} "
          f"library={mod.library_version()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
