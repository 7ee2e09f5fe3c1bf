"""The training step as users see it: DDP on a small ResNet and FSDP2 on a small transformer, step time on accl,
gloo and PyTorch's own MPI backend against the same step with no communication (the compute floor).

Run under MPI, one rank per core (``mpiexec -n 2 python bench/training_step.py``; across nodes
``mpiexec -n 2 --host node1:1,node2:1 ...``).  Every implementation trains its own copy of the same model (same
seed, same synthetic batches) in interleaved rounds: a round runs ``--steps`` timed steps (after one untimed) of
the floor, then of each backend, starting one further along the list each round, so that a noisy machine hurts
each alike.  A round's figure is the slowest rank's mean step.  The table shows the median round, the spread
((max - min) / median), the overhead over the floor (what communication costs the step), and each backend's step
time over accl's (> 1: accl faster).

* ``ddp``: ResNet-18's layout (four stages of two basic blocks) at ``--width`` base channels on 32x32 images,
  ``--batch`` images per rank, SGD with momentum; DDP's default 25 MB buckets, all_reduce overlapped with the
  backward pass.
* ``fsdp``: a pre-norm transformer (``--layers`` layers of ``--dim``, 4 heads, sequence 64), every layer and
  the whole model ``fully_shard``-ed on the group's 1-D mesh: parameters all-gathered before use, gradients
  reduce-scattered (``ReduceOp.AVG``; PyTorch's MPI backend has no AVG, so on it FSDP2 is told to sum and divide
  itself, ``set_force_sum_reduction_for_comms``), Adam.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "torchhpc" not in sys.modules:
    sys.path.insert(0, os.environ.get("TRAINING_STEP_SRC", str(Path(__file__).resolve().parents[1] / "src")))

import torch
import torch.distributed as dist
from torch import nn

from torchhpc.bench.timing import interleaved, per_call_s, slowest, summary

IMPLS = ("floor", "accl", "gloo", "mpi-upstream")


class Block(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm, and a 1x1 projection where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                  nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet18(width: int, classes: int = 10) -> nn.Module:
    """ResNet-18's layout for 32x32 images at `width` base channels (64: the original's 11 M parameters)."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for stage, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
        layers += [Block(cin, cout, 1 if stage == 0 else 2), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


class Transformer(nn.Module):
    """A small pre-norm transformer language model (token embedding, layers, tied-free output head)."""

    def __init__(self, dim: int, layers: int, vocab: int = 2048, seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def setup(kind: str, impl: str, group, args: argparse.Namespace):  # noqa: ANN001, ANN201
    """(step function, parameter count) for one implementation: its own model, optimizer and batches."""
    rank = dist.get_rank()
    torch.manual_seed(1234)
    gen = torch.Generator().manual_seed(100 + rank)
    if kind == "ddp":
        model = resnet18(args.width)
        batch = (torch.randn(args.batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen))
        if impl != "floor":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        model = Transformer(args.dim, args.layers)
        batch = (torch.randint(0, 2048, (args.batch, 64), generator=gen),
                 torch.randint(0, 2048, (args.batch, 64), generator=gen))
        if impl != "floor":
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            mesh = DeviceMesh.from_group(group, "cpu")
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            if impl == "mpi-upstream":  # it has no ReduceOp.AVG (FSDP2's default): SUM, then FSDP divides
                for module in (*model.layers, model):
                    module.set_force_sum_reduction_for_comms(True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = model(batch[0])
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), batch[1].reshape(-1))
        loss.backward()
        opt.step()

    return step, params


def groups(impls: list[str]) -> dict:
    """The process group of every backend in `impls` (accl's is the default group)."""
    out = {"floor": None, "accl": dist.group.WORLD}
    if "gloo" in impls:
        out["gloo"] = dist.new_group(backend="gloo")
    if "mpi-upstream" in impls:
        import torchhpc.mpi_upstream as upstream

        out["mpi-upstream"] = dist.new_group(backend=upstream.NAME)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="ddp,fsdp", help="comma list of ddp, fsdp")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ", ".join(IMPLS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round and implementation")
    ap.add_argument("--width", type=int, default=32, help="ddp: ResNet-18 base channels")
    ap.add_argument("--batch", type=int, default=16, help="images (ddp) or sequences (fsdp) per rank")
    ap.add_argument("--dim", type=int, default=256, help="fsdp: model width")
    ap.add_argument("--layers", type=int, default=4, help="fsdp: transformer layers")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 1 step, narrower models (seconds)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.width, args.dim, args.layers = 2, 1, 8, 64, 2

    from mpi4py import MPI

    import torchhpc.accl  # noqa: F401  (registers "accl")

    torch.set_num_threads(1)  # one rank per core
    dist.init_process_group("accl")
    comm = MPI.COMM_WORLD
    impls = [i for i in args.impls.split(",") if i]
    if "mpi-upstream" in impls:
        try:
            import torchhpc.mpi_upstream as upstream

            upstream.load()
        except Exception as exc:  # not built: `make mpi-backend`
            impls.remove("mpi-upstream")
            if comm.rank == 0:
                print(f"# skipping mpi-upstream: {type(exc).__name__}: {exc}")
    gs = groups(impls)
    hosts = sorted(set(comm.allgather(os.uname().nodename)))
    if comm.rank == 0:
        print(f"# training step, {comm.size} ranks on {len(hosts)} host(s), torch {torch.__version__}, "
              f"{args.rounds} interleaved rounds of {args.steps} steps; ms per step, the slowest rank's mean")
    for kind in args.models.split(","):
        runs = {impl: setup(kind, impl, gs[impl], args) for impl in impls}

        def measure(step) -> float:  # noqa: ANN001
            step()  # untimed: first-touch, DDP's rebuilt buckets, FSDP's lazy init
            comm.Barrier()
            return slowest(comm, per_call_s(step, args.steps))

        times = interleaved({impl: runs[impl][0] for impl in impls}, args.rounds, measure)
        if comm.rank == 0:
            report(kind, args, runs, times, impls)
    del runs  # the models hold their groups: freed first, destroying a group joins its workers before exit
    for impl in [i for i in gs if i not in ("floor", "accl")]:
        dist.destroy_process_group(gs[impl])
    dist.destroy_process_group()
    return 0


def report(kind: str, args: argparse.Namespace, runs: dict, times: dict[str, list[float]], impls: list[str]) -> None:
    what = (f"DDP, ResNet-18 layout at width {args.width}, {args.batch} images of 32x32 per rank"
            if kind == "ddp" else f"FSDP2, transformer {args.layers} x {args.dim}, {args.batch} x 64 tokens per rank")
    params = runs[impls[0]][1]
    print(f"\n## {what} ({params / 1e6:.2f} M parameters, {4 * params / 2**20:.1f} MiB of gradients)\n")
    print("| implementation | step ms | spread | overhead over the floor, ms | step / accl's |")
    print("| --- | ---: | ---: | ---: | ---: |")
    stats = {i: summary(times[i]) for i in impls}  # (median, min, max)
    med = {i: stats[i][0] for i in impls}
    floor = med.get("floor")
    for impl in impls:
        spread = (stats[impl][2] - stats[impl][1]) / med[impl]
        over = f"{1e3 * (med[impl] - floor):.1f}" if floor is not None and impl != "floor" else ""
        ratio = f"{med[impl] / med['accl']:.2f}x" if "accl" in med and impl not in ("floor", "accl") else ""
        print(f"| {impl} | {1e3 * med[impl]:.1f} | {100 * spread:.0f}% | {over} | {ratio} |")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
