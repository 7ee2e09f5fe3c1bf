"""A training script to start from: data-parallel training of a small model on synthetic data, under any launcher.

Copy it and replace ``make_model`` and ``make_batch`` with your own.  It runs unchanged under each launcher::

    mpiexec -n 4 python examples/train.py                        # one node, or --host/--hostfile for more
    srun --mpi=pmix -N 2 --ntasks-per-node 4 python examples/train.py
    torchrun --nproc-per-node 4 examples/train.py
    torchhpc jobscript --nodes 2 --submit -- python examples/train.py --steps 1000   # a PBS or Slurm job

What it does for you:

- the ranks come from the launcher (``torchhpc.launcher.init_distributed``: mpiexec, PALS, Slurm, torchrun); no
  MASTER_ADDR/MASTER_PORT to set;
- the backend follows the device: ``nccl`` with one GPU per rank where CUDA is available; on CPUs ``accl``
  (torchhpc's MPI backend) when an MPI launcher started the ranks, else ``gloo`` (torchrun); ``--backend``
  overrides;
- a checkpoint every ``--every`` steps into ``--ckpt`` (a folder every node sees); the same command resumes from the
  newest finished one after a requeue or a restart (``torchhpc.checkpoint``);
- rank 0 prints where each rank runs, then every ``--log-every`` steps the loss, the step time and the throughput
  in samples per second over all ranks, and at the end the median throughput.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchhpc import checkpoint
from torchhpc.launcher import init_distributed, mpi_launcher


def make_model(width: int) -> nn.Module:
    """The model: replace with yours."""
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, 4 * width), nn.GELU(),
                         nn.Linear(4 * width, 10))


def make_batch(step: int, rank: int, batch: int, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """This rank's batch for ``step``: replace with your data loader.  Synthetic, and a function of (step, rank)
    alone, so that a resumed run sees the batches an uninterrupted one would."""
    g = torch.Generator().manual_seed(step * 65_537 + rank)
    x = torch.randn(batch, width, generator=g)
    y = (x[:, :10].sum(dim=1) * 3).long().clamp(0, 9)  # a rule the model can learn
    return x.to(device), y.to(device)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="training steps in all (a resumed run does the rest)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ckpt", default="checkpoints", help="checkpoint folder, on a file system every node sees")
    p.add_argument("--every", type=int, default=50, help="checkpoint every this many steps (0: never)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--backend", default=None,
                   help="default: nccl on GPUs; on CPUs accl under an MPI launcher, else gloo")
    args = p.parse_args(argv)
    if min(args.steps, args.batch, args.width, args.log_every) < 1 or args.every < 0:
        p.error("--steps, --batch, --width and --log-every must be positive, --every at least 0")

    gpu = torch.cuda.is_available()
    backend = args.backend or ("nccl" if gpu else "accl" if mpi_launcher() else "gloo")
    info = init_distributed(backend)  # binds one GPU per local rank
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = DistributedDataParallel(make_model(args.width).to(device), device_ids=[device.index] if gpu else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    state = {"model": model, "optim": opt}
    found = checkpoint.latest(args.ckpt) if args.every else None
    start = checkpoint.load(state, found) if found is not None else 0
    hosts = [""] * info.world_size
    dist.all_gather_object(hosts, socket.gethostname())  # where the launcher put each rank
    if info.rank == 0:
        print("ranks on hosts: " + " ".join(f"{r}:{h}" for r, h in enumerate(hosts)), flush=True)
        print(f"{'resumed at' if found else 'starting at'} step {start} of {args.steps}: {info.world_size} ranks, "
              f"backend {dist.get_backend()}, device {device.type}", flush=True)

    rates, loss = [], torch.zeros(())
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        x, y = make_batch(step, info.rank, args.batch, args.width, device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients across ranks here
        opt.step()
        if gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        rates.append(args.batch * info.world_size / seconds)
        done = step + 1
        if args.every and (done % args.every == 0 or done == args.steps):
            checkpoint.save(state, args.ckpt, done)
        if info.rank == 0 and (done % args.log_every == 0 or done == args.steps):
            print(f"step {done:6d}  loss {loss.item():.4f}  {seconds * 1e3:7.1f} ms/step  "
                  f"{rates[-1]:9.0f} samples/s", flush=True)
    summary = torch.tensor([loss.item()], device=device)
    dist.all_reduce(summary)  # the mean final loss over ranks: every rank's, not only rank 0's
    result = {"start": start, "loss": summary.item() / info.world_size,
              "samples_per_s": statistics.median(rates) if rates else 0.0}
    if info.rank == 0:
        print(f"done: {args.steps} steps, mean final loss {result['loss']:.4f}, median "
              f"{result['samples_per_s']:.0f} samples/s on {info.world_size} ranks", flush=True)
    del model, opt, state
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
