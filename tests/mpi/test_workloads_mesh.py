"""DeviceMesh, FSDP2, HSDP, tensor parallel, DTensor and distributed checkpoint on accl, each equal to gloo.

Every test runs the same workload twice in this job, first with a gloo default group, then with an accl
one, and compares.  Bitwise: data movement, and reductions over 2-rank mesh dimensions (a + b is the same
float either way round).  Tolerance: reductions over all 4 ranks, where gloo's ring and MPI's algorithm add
in different orders (float64 throughout, so the tolerance is tight).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _backend_compare import compare_backends, detached, run_both, run_on
from mpi4py import MPI
from torch import nn

MPI_RANKS = (4,)
MPI_TIMEOUT = 300

STEPS = 3


def _mlp() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).double()


def _batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's own batch (different on every rank, the same on both backends)."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return (torch.randn(rows, 8, generator=g, dtype=torch.float64),
            torch.randn(rows, 4, generator=g, dtype=torch.float64))


def test_device_mesh_2d_collectives_over_each_dim() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    def workload() -> list[torch.Tensor]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        rank = dist.get_rank()
        out = []
        for dim in ("dp", "tp"):
            group = mesh.get_group(dim)
            assert dist.get_world_size(group) == 2
            base = torch.linspace(-1, 1, 12, dtype=torch.float64) * (rank + 1) / 3
            t = base.clone()
            dist.all_reduce(t, group=group)
            out.append(t)
            t = base.clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            out.append(t)
            gathered = torch.empty(24, dtype=torch.float64)
            dist.all_gather_into_tensor(gathered, base, group=group)
            out.append(gathered)
            lst = [torch.empty(12, dtype=torch.float64) for _ in range(2)]
            dist.all_gather(lst, base, group=group)
            out += lst
            rs = torch.empty(6, dtype=torch.float64)
            dist.reduce_scatter_tensor(rs, base, group=group)
            out.append(rs)
            b = base.clone()
            dist.broadcast(b, src=mesh[dim].mesh[1].item(), group=group)
            out.append(b)
            a2a = torch.empty(12, dtype=torch.float64)
            dist.all_to_all_single(a2a, base, group=group)
            out.append(a2a)
            out.append(torch.tensor(mesh.get_local_rank(dim)))
        return out

    compare_backends(run_both(workload), bitwise=True, what="2-D mesh collectives")


def _train_fsdp(shard) -> list[torch.Tensor]:
    model = _mlp()
    shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return detached(list(model.parameters())) + losses


def test_fsdp2_fully_shard_1d_mesh() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def shard(model: nn.Module) -> None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    # gradients are reduce-scattered over 4 ranks: different summation order than gloo
    compare_backends(run_both(lambda: _train_fsdp(shard)), bitwise=False, what="FSDP2 1-D")


def test_hsdp_2d_mesh() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def shard(model: nn.Module) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    # reduce-scatter over 2 ranks then all-reduce over 2 ranks: each a two-term sum, hence bitwise
    compare_backends(run_both(lambda: _train_fsdp(shard)), bitwise=True, what="HSDP 2-D")


def test_tensor_parallel_colwise_rowwise() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def workload() -> list[torch.Tensor]:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()
        model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        outs = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)  # TP: every rank sees the same input
            x = torch.randn(6, 8, generator=g, dtype=torch.float64)
            opt.zero_grad()
            y = model(x)
            y.sum().backward()
            opt.step()
            outs.append(y.detach().clone())
        return detached(list(model.parameters())) + outs

    # RowwiseParallel all-reduces partial outputs of 4 ranks: tolerance
    compare_backends(run_both(workload), bitwise=False, what="tensor parallel")


def test_dtensor_redistribute_full_tensor() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    def workload() -> list[torch.Tensor]:
        mesh = init_device_mesh("cpu", (2, 2))
        torch.manual_seed(11)
        full = torch.randn(8, 12, dtype=torch.float64)
        out = []
        d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
        out.append(d.to_local().clone())
        for placements in ([Replicate(), Shard(0)], [Shard(1), Replicate()], [Shard(1), Shard(0)],
                           [Replicate(), Replicate()]):
            r = d.redistribute(mesh, placements)  # all-gathers and all-to-alls
            out += [r.to_local().clone(), r.full_tensor()]
        local = torch.full((4, 6), float(dist.get_rank() + 1), dtype=torch.float64)
        p = torch.distributed.tensor.DTensor.from_local(local, mesh, [Partial(), Partial()])
        out.append(p.redistribute(mesh, [Replicate(), Shard(0)]).to_local().clone())  # reduce-scatter
        out.append(p.full_tensor())                                                   # all-reduce
        assert torch.equal(d.full_tensor(), full)
        return out

    # pure data movement and sums of small integers (exact in float64): bitwise
    compare_backends(run_both(workload), bitwise=True, what="DTensor redistribute")


def test_distributed_checkpoint_save_load_sharded(shared_tmp) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def sharded_model(seed: int) -> nn.Module:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()
        fully_shard(model, mesh=mesh)
        return model

    dirs = {b: str(shared_tmp / b) for b in ("gloo", "accl")}  # dcp.save creates them, on every rank

    def save(backend: str):
        def workload() -> list[torch.Tensor]:
            model = sharded_model(seed=5)
            dcp.save(model.state_dict(), checkpoint_id=dirs[backend])
            return detached(list(model.parameters()))
        return workload

    def load(backend: str):
        def workload() -> list[torch.Tensor]:
            model = sharded_model(seed=6)  # different weights until loaded
            state = model.state_dict()
            dcp.load(state, checkpoint_id=dirs[backend])
            model.load_state_dict(state)
            return detached(list(model.parameters()))
        return workload

    saved = {b: run_on(b, save(b)) for b in ("gloo", "accl")}
    compare_backends(saved, bitwise=True, what="saved parameters")
    # each backend loads its own checkpoint and the other's: all four bitwise equal to what was saved
    for writer in ("gloo", "accl"):
        loaded = {b: run_on(b, load(writer)) for b in ("gloo", "accl")}
        compare_backends({"gloo": saved["gloo"], "accl": loaded["accl"]}, bitwise=True,
                         what=f"accl loading {writer}'s checkpoint")
        compare_backends({"gloo": saved["gloo"], "accl": loaded["gloo"]}, bitwise=True,
                         what=f"gloo loading {writer}'s checkpoint")
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.Get_rank() == 0:
        import shutil
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("how", ["new_subgroups", "by_enumeration"])
def test_subgroups(how: str) -> None:
    def workload() -> list[torch.Tensor]:
        rank = dist.get_rank()
        if how == "new_subgroups":
            cur, groups = dist.new_subgroups(group_size=2)
            assert len(groups) == 2
        else:
            cur, groups = dist.new_subgroups_by_enumeration([[0, 3], [1, 2]])
        t = torch.arange(5, dtype=torch.float64) + 10 * rank
        dist.all_reduce(t, group=cur)
        lst = [None] * dist.get_world_size(cur)
        dist.all_gather_object(lst, {"rank": rank}, group=cur)
        b = torch.tensor([float(rank)])
        dist.broadcast(b, group_src=1, group=cur)
        return [t, b, torch.tensor([x["rank"] for x in lst])]

    compare_backends(run_both(workload), bitwise=True, what=how)
