"""Data-parallel training that survives a lost node: a checkpoint every N steps, resumed when the job restarts.

The same command starts and restarts the job; it looks for the newest finished checkpoint in ``--dir`` (a
directory every node sees) and goes on from its step::

    torchrun --nproc-per-node 2 --max-restarts 3 examples/resumable_training.py --dir ckpt
    sbatch --requeue -N 2 --wrap "srun --mpi=pmix python examples/resumable_training.py --dir ckpt"
    qsub -r y -l select=2:ncpus=1:mpiprocs=1 -- mpiexec python examples/resumable_training.py --dir ckpt

A restart loses only the steps since the newest checkpoint: the model, the optimizer, the data position (batches
are a function of the step) and every rank's random state are restored, so the final parameters equal those of
a run never stopped, bit for bit, when it restarts with the same number of ranks.  Rank 0 prints the SHA-256 of
the final parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchhpc import checkpoint
from torchhpc.launcher import init_distributed

# Restart counters that torchrun and Slurm give a restarted job, for the log line only (PBS keeps its
# run_count in the job's record: `qstat -f`).
RESTARTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def batch(step: int, rank: int, args: argparse.Namespace, teacher: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's minibatch of ``step``: a function of (seed, step, rank) alone, so a resumed job sees the
    batches an uninterrupted one would."""
    g = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 4099 + rank)
    x = torch.randn(args.batch, args.width, generator=g)
    return x, torch.sin(x @ teacher)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="checkpoint directory, on a file system every node sees")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="checkpoint every this many steps")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds any collective waits for its peers before every rank raises")
    args = p.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        p.error("--steps and --every must be positive")

    info = init_distributed(args.backend, timeout=args.timeout)
    rank = info.rank
    torch.manual_seed(args.seed)  # the same initial model and teacher on every rank
    teacher = torch.randn(args.width, 8) / args.width ** 0.5
    # find_unused_parameters keeps DDP's first gradient buckets: it otherwise regroups them after the first step
    # a run takes, so a resumed run's first step would sum in another order (other bits from 3 ranks on)
    model = DistributedDataParallel(nn.Sequential(
        nn.Linear(args.width, args.width), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(args.width, args.width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(args.width, 8)),
        find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    state = {"model": model, "optim": opt}
    torch.manual_seed(args.seed * 1000 + 1 + rank)  # each rank's own dropout stream

    found = checkpoint.latest(args.dir)
    start = checkpoint.load(state, found) if found is not None else 0
    restarts = "".join(f" ({v}={os.environ[v]})" for v in RESTARTS if v in os.environ)
    if rank == 0:
        print(f"{'RESUMED at' if found else 'STARTED at'} step {start} of {args.steps} on {info.world_size} "
              f"ranks{restarts}", flush=True)
    losses = []
    for step in range(start, args.steps):
        x, y = batch(step, rank, args, teacher)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if (step + 1) % args.every == 0 or step + 1 == args.steps:
            checkpoint.save(state, args.dir, step + 1)
            if rank == 0:
                print(f"CHECKPOINT step {step + 1} loss {losses[-1]:.5f}", flush=True)
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.module.parameters()))
    if rank == 0:
        print(f"FINAL step {args.steps} sha256 {digest.hexdigest()}", flush=True)
    del model, opt, state  # DDP holds the group: freed first, destroying it joins gloo's workers before exit
    dist.destroy_process_group()
    return {"start": start, "losses": losses, "sha256": digest.hexdigest()}


if __name__ == "__main__":
    main()
