"""DDP (static graph, unused parameters, small buckets, no_sync, fp16/bf16 compression), ZeroRedundancyOptimizer,
autograd all_reduce, object collectives and asymmetric subgroups on accl, each equal to the same script on gloo.

At 2 ranks every reduction is a sum of two terms, the same float in either order: accl must match gloo bit
for bit.  At 3 ranks gloo's ring and MPI's algorithm may add in different orders: float tolerance (float64,
so tight; the fp16/bf16 hooks round each partial sum to 16 bits, so their tolerance is that precision's).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _backend_compare import compare_backends, detached, run_both
from mpi4py import MPI
from torch import nn

MPI_RANKS = (2, 3)
MPI_TIMEOUT = 300

STEPS = 3


def _bitwise() -> bool:
    return MPI.COMM_WORLD.Get_size() == 2


class _Net(nn.Module):
    """Two linear layers and a branch that is used only when asked (for find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(21)
        self.a = nn.Linear(6, 12)
        self.b = nn.Linear(12, 3)
        self.extra = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) + (self.extra(h) if use_extra else 0)


def _batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + dist.get_rank())
    return (torch.randn(5, 6, generator=g, dtype=torch.float64),
            torch.randn(5, 3, generator=g, dtype=torch.float64))


DDP_CASES = {
    "default": {},
    "static_graph": {"static_graph": True},
    "find_unused_parameters": {"find_unused_parameters": True},
    "small_buckets": {"bucket_cap_mb": 0.0002},
    "no_sync": {},
    "fp16_hook": {},
    "bf16_hook": {},
}


def _cpu_bf16_compress_hook(state, bucket):  # no annotations: DDP compares them as objects
    """torch's own ``bf16_compress_hook``, under another name: DDP refuses that name unless CUDA+NCCL or XPU
    are present (a check on the hook's ``__name__``, for gloo as for accl), though the hook itself is plain torch."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


@pytest.mark.parametrize("case", list(DDP_CASES))
def test_ddp(case: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    def workload() -> list[torch.Tensor]:
        model = _Net().double()
        if dist.get_rank() != 0:  # DDP's initial broadcast must make the replicas equal
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
        ddp = DDP(model, **DDP_CASES[case])
        if case == "fp16_hook":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif case == "bf16_hook":
            ddp.register_comm_hook(None, _cpu_bf16_compress_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            use_extra = not (case == "find_unused_parameters" and step % 2 == 1)
            if case == "no_sync":
                with ddp.no_sync():  # accumulate locally, reduce on the next backward
                    x, y = _batch(step, micro=1)
                    nn.functional.mse_loss(ddp(x), y).backward()
            x, y = _batch(step)
            loss = nn.functional.mse_loss(ddp(x, use_extra), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
        return detached(list(model.parameters())) + losses

    tol = {"fp16_hook": 2e-3, "bf16_hook": 2e-2}.get(case, 1e-10)
    compare_backends(run_both(workload), bitwise=_bitwise(), rtol=tol, atol=tol, what=f"DDP {case}")


def test_zero_redundancy_optimizer() -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    def workload() -> list[torch.Tensor]:
        model = _Net().double()
        ddp = DDP(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _batch(step)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()  # each rank updates its shard, then broadcasts it
        opt.consolidate_state_dict(to=0)
        state = opt.state_dict() if dist.get_rank() == 0 else None
        out = detached(list(model.parameters()))
        if state is not None:
            out += [s["exp_avg"].clone() for _, s in sorted(state["state"].items())]
        return out

    compare_backends(run_both(workload), bitwise=_bitwise(), what="ZeroRedundancyOptimizer")


def test_autograd_all_reduce() -> None:
    import torch.distributed.nn.functional as dnn

    def workload() -> list[torch.Tensor]:
        rank = dist.get_rank()
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.randn(3, generator=g, dtype=torch.float64)
        y = dnn.all_reduce(x * w)             # forward: sum over ranks
        (y * (rank + 1)).sum().backward()     # backward: the gradient is all-reduced too
        z = dnn.all_gather(x.sum(0))
        gathered = torch.stack(z)
        return [y.detach(), x.grad.clone(), gathered.detach()]

    compare_backends(run_both(workload), bitwise=_bitwise(), what="torch.distributed.nn all_reduce")


def test_object_collectives() -> None:
    def workload() -> list:
        rank, size = dist.get_rank(), dist.get_world_size()
        obj = {"rank": rank, "name": f"r{rank}", "t": torch.arange(rank + 2)}
        gathered = [None] * size
        dist.all_gather_object(gathered, obj)
        g0 = [None] * size if rank == 0 else None
        dist.gather_object(obj, g0, dst=0)
        lst = [f"from{rank}", rank * 2] if rank == size - 1 else [None, None]
        dist.broadcast_object_list(lst, src=size - 1)
        out = [None]
        dist.scatter_object_list(out, [{"to": r} for r in range(size)] if rank == 0 else None, src=0)
        if rank == 0:
            dist.send_object_list([("hello", 1)], dst=1)
            recvd = [None]
        elif rank == 1:
            recvd = [None]
            dist.recv_object_list(recvd, src=0)
        else:
            recvd = [None]
        return [repr(gathered), repr(g0), repr(lst), repr(out), repr(recvd)]

    compare_backends(run_both(workload), bitwise=True, what="object collectives")


def test_asymmetric_subgroups() -> None:
    """Groups of neighbouring pairs (a pipeline) and a subset group: ranks join different numbers of groups."""
    def workload() -> list[torch.Tensor]:
        rank, size = dist.get_rank(), dist.get_world_size()
        pairs = [dist.new_group([i, i + 1]) for i in range(size - 1)]
        out = []
        for i, g in enumerate(pairs):
            if rank in (i, i + 1):
                t = torch.tensor([float(rank + 1), 2.0 * rank])
                dist.all_reduce(t, group=g)
                out.append(t)
        first = dist.new_group([0, 1])  # a repeat of an earlier membership
        cur, _ = dist.new_subgroups_by_enumeration([[0], list(range(1, size))])
        if rank < 2:
            t = torch.ones(3) * rank
            dist.all_reduce(t, group=first)
            out.append(t)
        t = torch.ones(2) * (rank + 1)
        dist.all_reduce(t, group=cur)
        out.append(t)
        return out

    compare_backends(run_both(workload), bitwise=True, what="asymmetric subgroups")
