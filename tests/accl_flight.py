"""An accl job whose last rank skips an all_reduce and calls a broadcast instead (the others make the all_reduce):
every rank raises MismatchError and writes its flight record, which tests/test_accl_flight.py hands to torch's
analyzer.  ``python accl_flight.py DUMP_PREFIX``; ``TORCH_FR_BUFFER_SIZE`` is torch's."""

from __future__ import annotations

import os
import sys
from datetime import timedelta


def main(argv: list[str]) -> int:
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = argv[0]  # torch's writer reads it when first used
    import torch
    import torch.distributed as dist

    from torchhpc.launcher import init_distributed
    from torchhpc.runtime.errors import MismatchError

    init_distributed(backend="accl", timeout=timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)
    for _ in range(2):
        dist.all_reduce(t)
    out = [torch.empty(4) for _ in range(size)]
    dist.all_gather(out, t)
    if rank == 0:
        dist.send(t, 1)
    elif rank == 1:
        dist.recv(t, 0)
    try:
        if rank == size - 1:
            dist.broadcast(t, 0)  # the skipped all_reduce
        else:
            dist.all_reduce(t)
    except MismatchError:
        print(f"RANK {rank} MismatchError", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
