"""Class-incremental learning on scikit-learn's bundled digits, with and without a rehearsal buffer.

Five tasks of two classes each arrive one after the other.  A small MLP trained on them in
sequence forgets the old classes; a distributed rehearsal buffer (each rank keeps a slice,
every rank rehearses from all of them) mixes a few stored samples into every minibatch and
keeps them alive.  Data-parallel under MPI (gradients averaged with ``Allreduce``)::

    mpiexec -n 4 python examples/continual_digits.py
    python examples/continual_digits.py            # one rank works too

Prints, on rank 0, the accuracy on every task after training on each task, and the final
average accuracy, for both runs.
"""

from __future__ import annotations

import argparse
import socket
import time

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from torchhpc.rehearsal import RehearsalBuffer, RehearsalLoader
from torchhpc.rehearsal.options import TRANSPORTS

TASKS = [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]


def load(seed: int) -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.3, random_state=seed, stratify=y)
    return xtr, ytr, xte, yte


def shard_batches(x: torch.Tensor, y: torch.Tensor, rank: int, size: int, batch: int, seed: int):
    """This rank's minibatches of one epoch; every rank gets the same number (lock-step Allreduce)."""
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    per_rank = len(y) // size
    mine = perm[rank * per_rank : (rank + 1) * per_rank]
    steps = per_rank // batch
    chunks = [mine[i * batch : (i + 1) * batch] for i in range(steps)]
    return [(x[idx], y[idx]) for idx in chunks]


def average_gradients(model: nn.Module, comm: MPI.Comm) -> None:
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    comm.Allreduce(MPI.IN_PLACE, grads.numpy(), op=MPI.SUM)
    grads /= comm.Get_size()
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.grad.copy_(grads[offset : offset + n].view_as(p))
        offset += n


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, classes: tuple[int, ...]) -> float:
    mask = torch.isin(y, torch.tensor(classes))
    with torch.no_grad():
        return (model(x[mask]).argmax(1) == y[mask]).float().mean().item()


def run(rehearsal: bool, args: argparse.Namespace, comm: MPI.Comm) -> np.ndarray:
    """Train on the tasks in sequence; return acc[i, j] = accuracy on task j after task i."""
    rank, size = comm.Get_rank(), comm.Get_size()
    xtr, ytr, xte, yte = load(args.seed)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    buffer = None
    if rehearsal:
        buffer = RehearsalBuffer(num_classes=10, slots_per_class=args.slots, num_candidates=args.candidates,
                                 num_representatives=args.representatives, sample_shapes=(64,),
                                 seed=args.seed, comm=comm, transport=args.transport)
    acc = np.zeros((len(TASKS), len(TASKS)))
    for t, classes in enumerate(TASKS):
        mask = torch.isin(ytr, torch.tensor(classes))
        for epoch in range(args.epochs):
            batches = shard_batches(xtr[mask], ytr[mask], rank, size, args.batch, args.seed + 100 * t + epoch)
            stream = RehearsalLoader(batches, buffer) if buffer is not None else batches
            for batch in stream:
                x, y = batch[0], batch[1]
                w = batch[2] if buffer is not None else torch.ones(len(y))
                opt.zero_grad()
                loss = (F.cross_entropy(model(x), y, reduction="none") * w).sum() / w.sum()
                loss.backward()
                average_gradients(model, comm)
                opt.step()
        for j, seen in enumerate(TASKS[: t + 1]):
            acc[t, j] = accuracy(model, xte, yte, seen)
    if buffer is not None:
        if rank == 0:
            st = buffer.stats()
            engines = getattr(buffer.storage, "addresses", None)  # the Thallium engines' addresses, by rank
            print(f"rank 0 buffer: transport {buffer.transport}"
                  + (f", engines {' '.join(engines)}" if engines else ""))
            print(f"rank 0 buffer: {st['size']}/{st['capacity']} samples, per-stage ms "
                  + ", ".join(f"{k} {v:.2f}" for k, v in st["timings_ms"].items()))
        buffer.close()
    return acc


def report(name: str, acc: np.ndarray) -> None:
    print(f"\n{name}: accuracy on task j (columns) after training task i (rows)")
    print("        " + " ".join(f"task{j} {c}" for j, c in enumerate(TASKS)))
    for i, row in enumerate(acc):
        print(f"after {i}  " + " ".join(f"{v:12.3f}" if j <= i else " " * 12 for j, v in enumerate(row)))
    print(f"{name}: final average accuracy {acc[-1].mean():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="new samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--slots", type=int, default=10, help="slots per class on each rank")
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--representatives", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transport", choices=TRANSPORTS, default="auto",
                        help="how ranks read each other's slots (auto: Thallium across nodes where built, else MPI)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    hosts = comm.gather(socket.gethostname())
    if comm.Get_rank() == 0:
        print("ranks on hosts: " + " ".join(f"{rank}:{host}" for rank, host in enumerate(hosts)), flush=True)
    t0 = time.perf_counter()
    plain = run(False, args, comm)
    rehearsed = run(True, args, comm)
    if comm.Get_rank() == 0:
        print(f"{comm.Get_size()} rank(s), {args.epochs} epochs per task, {args.batch} new samples per rank "
              f"per step, rehearsal R={args.representatives} C={args.candidates} N={args.slots}")
        report("without rehearsal", plain)
        report("with rehearsal", rehearsed)
        print(f"\nfinal average accuracy {plain[-1].mean():.3f} without rehearsal, "
              f"{rehearsed[-1].mean():.3f} with ({time.perf_counter() - t0:.1f}s)")


if __name__ == "__main__":
    main()
