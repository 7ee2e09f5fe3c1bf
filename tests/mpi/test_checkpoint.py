"""torchhpc.checkpoint: what a restarted job may trust.  A checkpoint is finished only once renamed from
``.partial``; a write cut short is never loaded; load restores model, optimizer and each rank's random state
exactly; old ones are pruned; errors reach every rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torchhpc.accl  # noqa: F401  (registers "accl")
from torchhpc import checkpoint
from torchhpc.checkpoint import CheckpointError

MPI_RANKS = (2, 3)


@pytest.fixture(scope="module", autouse=True)
def group():
    dist.init_process_group("accl")
    yield
    dist.destroy_process_group()


def _trained(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Dropout(0.3),
                                                        torch.nn.Linear(5, 3)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(seed + 1 + dist.get_rank())
    for _ in range(steps):
        _step(model, opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(4, 6)  # from this rank's own stream: restored with the checkpoint
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_resumed_run_equals_an_uninterrupted_one_bitwise(shared_tmp: Path) -> None:
    model, opt = _trained(0, 3)
    path = checkpoint.save({"model": model, "optim": opt, "epoch": torch.tensor(7)}, shared_tmp, 3)
    assert path == shared_tmp / "step-00000003" and checkpoint.latest(shared_tmp) == path
    for _ in range(4):
        _step(model, opt)
    want = _params(model)

    fresh, fresh_opt = _trained(1, 0)  # other weights, no optimizer state, another random stream
    epoch = torch.tensor(0)
    state = {"model": fresh, "optim": fresh_opt, "epoch": epoch}
    assert checkpoint.load(state, checkpoint.latest(shared_tmp)) == 3 and int(epoch) == 7
    for _ in range(4):
        _step(fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh), want, strict=True))


def test_a_partial_checkpoint_is_never_taken_and_is_replaced(shared_tmp: Path) -> None:
    model, opt = _trained(0, 1)
    checkpoint.save({"model": model, "optim": opt}, shared_tmp, 10)
    dist.barrier()
    if dist.get_rank() == 0:  # what a node lost during the write of step 20 leaves: parts, even metadata
        cut = shared_tmp / "step-00000020.partial"
        cut.mkdir()
        (cut / ".metadata").write_bytes(b"torn")
        (cut / "__0_0.distcp").write_bytes(b"torn")
    dist.barrier()
    assert checkpoint.latest(shared_tmp) == shared_tmp / "step-00000010"
    checkpoint.save({"model": model, "optim": opt}, shared_tmp, 20)
    assert checkpoint.latest(shared_tmp) == shared_tmp / "step-00000020"
    assert not (shared_tmp / "step-00000020.partial").exists()


def test_only_the_newest_are_kept(shared_tmp: Path) -> None:
    model, opt = _trained(0, 1)
    for step in (1, 2, 3, 4):
        checkpoint.save({"model": model, "optim": opt}, shared_tmp, step, keep=2)
    assert sorted(p.name for p in shared_tmp.iterdir()) == ["step-00000003", "step-00000004"]


def test_a_directory_that_cannot_be_written_fails_every_rank(shared_tmp: Path) -> None:
    blocker = shared_tmp / "file"
    if dist.get_rank() == 0:
        blocker.write_text("not a directory")
    dist.barrier()
    model, opt = _trained(0, 1)
    with pytest.raises(CheckpointError, match="could not prepare"):
        checkpoint.save({"model": model, "optim": opt}, blocker / "ckpt", 1)


def test_bad_arguments_are_named(shared_tmp: Path) -> None:
    model, opt = _trained(0, 1)
    with pytest.raises(ValueError, match="keep >= 1"):
        checkpoint.save({"model": model}, shared_tmp, 1, keep=0)
    with pytest.raises(CheckpointError, match="not a finished checkpoint"):
        checkpoint.load({"model": model}, shared_tmp / "step-00000001.partial")
    with pytest.raises(CheckpointError, match="beside its module"):
        checkpoint.save({"net": model, "optim": opt}, shared_tmp, 1)
    assert checkpoint.latest(shared_tmp / "none") is None
    assert not os.listdir(shared_tmp)
