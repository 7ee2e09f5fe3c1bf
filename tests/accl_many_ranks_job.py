"""One job of ``test_accl_many_ranks.py``: all_to_all at more ranks than its byte matrix rides with the header.

Each rank checks what every rank sends it (one count each) and the ranks agree on the verdict; a mismatch gathers
the matrix and every rank raises the same error naming the pair.  Rank 0 prints ``OK`` and that error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import torchhpc.accl  # noqa: F401  (registers the backend)
from torchhpc.runtime.errors import MismatchError


def main() -> None:
    dist.init_process_group("accl")
    r, p = dist.get_rank(), dist.get_world_size()
    send = [(r + j) % 3 + 1 for j in range(p)]  # uneven: rank r sends (r + j) % 3 + 1 elements to rank j
    recv = [(i + r) % 3 + 1 for i in range(p)]
    inp = torch.cat([torch.full((n,), float(r * 1000 + j)) for j, n in enumerate(send)])
    out = torch.empty(sum(recv))
    dist.all_to_all_single(out, inp, recv, send)
    assert torch.equal(out, torch.cat([torch.full((n,), float(i * 1000 + r)) for i, n in enumerate(recv)]))
    even, got = torch.arange(2 * p, dtype=torch.float32) + 100 * r, torch.empty(2 * p)
    dist.all_to_all_single(got, even)  # every rank the same bytes: MPI_Alltoall
    assert torch.equal(got, torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * i
                                       for i in range(p)]))
    bad = recv[:1] + recv[1:] if r != p - 1 else [recv[0] + 1, *recv[1:]]  # the last rank expects one more
    try:
        dist.all_to_all_single(torch.empty(sum(bad)), inp, bad, send)
        raise SystemExit(f"rank {r}: a mismatched all_to_all did not raise")
    except MismatchError as e:
        texts = [None] * p
        dist.all_gather_object(texts, str(e))
    assert len(set(texts)) == 1, texts
    dist.all_to_all_single(out, inp, recv, send)  # the group goes on
    if r == 0:
        print("OK", texts[0], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
