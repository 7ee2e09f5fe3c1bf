"""Train a convolutional ResNet on scikit-learn's bundled digits, layer-parallel with MGRIT and serially.

Run under MPI (any rank count up to the number of layers):

    mpiexec -n 4 python examples/layer_parallel_digits.py --steps 32 --levels 3 --cfactor 4

The network is an opening convolution, ``--steps`` residual steps ``x + dt * relu(conv(x))``
(an ODE block over [0, Tf]) and a linear classifier.  Every rank builds the same initial weights;
the layer-parallel run trains with inexact MGRIT solves (``--iters`` forward/backward iterations),
then rank 0 trains the equivalent serial ``nn.Sequential`` from the same start for comparison.
No download: the data ship with scikit-learn.
"""

from __future__ import annotations

import argparse
import time

import torch
from mpi4py import MPI
from sklearn.datasets import load_digits
from torch import nn

from torchhpc.braid import LayerParallel
from torchhpc.braid.transport import allreduce, default_timeout


def data(seed: int = 0):
    """Digits as (N, 1, 8, 8) float tensors in [0, 1], split 80/20 with a fixed permutation."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


class Open(nn.Module):
    """Lift the image to ``channels`` feature maps."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class Step(nn.Module):
    """Residual branch f(x) = relu(conv(x)); LayerParallel applies x + dt * f(x)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class Close(nn.Module):
    """Classifier head."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels * 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


def train(model: nn.Module, params, xs, ys, epochs: int, batch: int, lr: float, seed: int) -> float:
    """Plain SGD with momentum; returns the wall time.  Same batches on every rank (seeded)."""
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for _ in range(epochs):
        perm = torch.randperm(len(ys), generator=gen)
        for i in range(0, len(ys), batch):
            idx = perm[i:i + batch]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xs[idx]), ys[idx])
            loss.backward()
            opt.step()
    return time.perf_counter() - t0


def accuracy(model: nn.Module, xs, ys) -> float:
    with torch.no_grad():
        return float((model(xs).argmax(1) == ys).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=32, help="residual steps (ODE layers)")
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--levels", type=int, default=3, help="MGRIT levels (1 = exact, pipelined)")
    ap.add_argument("--cfactor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=2, help="MGRIT iterations per forward and backward")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--Tf", type=float, default=1.0)
    ap.add_argument("--no-serial", action="store_true", help="skip the serial comparison on rank 0")
    args = ap.parse_args()
    torch.set_num_threads(1)

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    xtr, ytr, xte, yte = data()
    c = args.channels
    blocks = [lambda: Open(c), lambda: Step(c), lambda: Close(c)]
    lp = LayerParallel(comm, blocks, [1, args.steps, 1], args.Tf,
                       max_fwd_levels=args.levels, max_bwd_levels=args.levels, max_iters=args.iters)
    lp.setCFactor(args.cfactor)
    lp.setAbsTol(1e-6)
    serial = lp.build_sequential_on_root()  # same initial weights, before any training

    t_par = train(lp, lp.parameters(), xtr, ytr, args.epochs, args.batch, args.lr, seed=1)
    t_par = allreduce(comm, t_par, "max", default_timeout())  # a wait on peers with a deadline
    lp.eval()
    acc_par = accuracy(lp, xte, yte)
    fwd_its, fwd_res = lp.getFwdStats()
    if rank == 0:
        print(f"layer-parallel: {comm.Get_size()} ranks, {args.steps + 2} layers, {args.levels} levels, "
              f"cfactor {args.cfactor}, {args.iters} iterations")
        print(f"  train time {t_par:7.2f} s   test accuracy {acc_par:.3f}   "
              f"last forward residual {fwd_res[-1] if fwd_res else float('nan'):.2e}")
        if not args.no_serial:
            t_ser = train(serial, serial.parameters(), xtr, ytr, args.epochs, args.batch, args.lr, seed=1)
            serial.eval()
            acc_ser = accuracy(serial, xte, yte)
            print(f"serial:         train time {t_ser:7.2f} s   test accuracy {acc_ser:.3f}")
            print(f"  time ratio parallel/serial {t_par / t_ser:.2f} on this machine "
                  "(bench/braid.py models larger runs)")


if __name__ == "__main__":
    main()
