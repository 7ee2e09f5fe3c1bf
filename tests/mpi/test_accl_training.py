"""DDP and FSDP2 (fully_shard) train with the "accl" backend exactly like one process on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchhpc.accl  # noqa: F401  (registers "accl")

MPI_RANKS = (2, 4)
MPI_TIMEOUT = 240

GLOBAL_BATCH = 16
STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [(torch.randn(GLOBAL_BATCH, 8, generator=g, dtype=torch.float64),
             torch.randn(GLOBAL_BATCH, 4, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def reference_params() -> list[torch.Tensor]:
    model = make_model().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def local_slice(x: torch.Tensor) -> torch.Tensor:
    rank, p = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // p
    return x[rank * per:(rank + 1) * per]


@pytest.fixture(scope="module", autouse=True)
def world():
    dist.init_process_group("accl")
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.0005])
def test_ddp_matches_single_process(bucket_cap_mb: float) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # ranks start from different weights: DDP's initial broadcast must fix that
    model = make_model().double()
    if dist.get_rank() != 0:
        with torch.no_grad():
            for prm in model.parameters():
                prm.add_(1.0)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.mse_loss(ddp(local_slice(x)), local_slice(y)).backward()
        opt.step()
    for got, want in zip(model.parameters(), reference_params(), strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=1e-12)


def test_fsdp2_fully_shard_matches_single_process() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model().double()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.mse_loss(model(local_slice(x)), local_slice(y)).backward()
        opt.step()
    got = [prm.full_tensor().detach() for prm in model.parameters()]
    for g, w in zip(got, reference_params(), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
