"""All-to-all fetch of rows held by other nodes, over any torch.distributed backend."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["fetch_remote_rows"]


def _alltoall(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group: dist.ProcessGroup | None) -> None:
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)


def fetch_remote_rows(
    positions: torch.Tensor,
    dest: torch.Tensor,
    world_size: int,
    serve: Callable[[torch.Tensor], torch.Tensor],
    row_bytes: int,
    group: dist.ProcessGroup | None,
    comm_device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ask rank ``dest[i]`` for storage position ``positions[i]``; answer peers' requests with ``serve``.

    Collective over ``group``: every rank calls it, with zero requests if it needs no remote
    rows.  Rows travel as raw bytes, so every dtype works with every backend.  Returns the rows
    as a ``(len(positions), row_bytes)`` uint8 tensor grouped by serving rank, and ``order``:
    row ``i`` answers ``positions[order[i]]`` (the caller scatters once, straight to its output).
    """
    order = torch.argsort(dest, stable=True)
    send_pos = positions[order].to(torch.int64)
    send_counts = torch.bincount(dest, minlength=world_size).to(torch.int64)
    cnt_out = torch.empty(world_size, dtype=torch.int64, device=comm_device)
    _alltoall(cnt_out, send_counts.to(comm_device), [1] * world_size, [1] * world_size, group)
    recv_counts = cnt_out.cpu()
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    req = torch.empty(sum(rc), dtype=torch.int64, device=comm_device)
    _alltoall(req, send_pos.to(comm_device), rc, sc, group)
    rows = serve(req.cpu()).reshape(len(req), row_bytes).to(comm_device)
    got = torch.empty((len(send_pos), row_bytes), dtype=torch.uint8, device=comm_device)
    _alltoall(got, rows, sc, rc, group)
    return got, order
