"""torchhpc.checkpoint's commit on one rank: a crash between any two of its steps leaves a finished checkpoint
that loads, any step number is found and pruned, and what is written is private (the multi-rank behaviour is
tests/mpi/test_checkpoint.py; another user's planted step is tests/test_security.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchhpc import checkpoint


@pytest.fixture(autouse=True)
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Crash(BaseException):
    """A node lost at this instant: nothing after it runs, nothing catches it."""


def _model(value: float) -> torch.nn.Module:
    m = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m


def _loaded_value(path: Path) -> float:
    m = _model(0.0)
    checkpoint.load({"model": m}, path)
    return float(m.weight[0, 0].detach())


@pytest.mark.parametrize("crash_after", range(6))
def test_a_crash_between_any_two_commit_steps_leaves_a_finished_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash_after: int) -> None:
    """Re-saving step 5 (a job restarted past its last checkpoint saves that step again): the finished one was
    removed before the new one was renamed in, and a crash between the two left only ``.partial``."""
    checkpoint.save({"model": _model(1.0)}, tmp_path, 4)
    checkpoint.save({"model": _model(2.0)}, tmp_path, 5)
    real = checkpoint._commit_steps

    def crashing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        steps = real(*args, **kwargs)
        assert len(steps) == 5

        def boom() -> None:
            raise Crash

        return [*steps[:crash_after], boom] if crash_after < len(steps) else steps

    monkeypatch.setattr(checkpoint, "_commit_steps", crashing)
    if crash_after < 5:
        with pytest.raises(Crash):
            checkpoint.save({"model": _model(3.0)}, tmp_path, 5)
    else:
        checkpoint.save({"model": _model(3.0)}, tmp_path, 5)
    monkeypatch.undo()
    found = checkpoint.latest(tmp_path)
    assert found is not None and found.name.startswith("step-00000005"), sorted(os.listdir(tmp_path))
    assert _loaded_value(found) in (2.0, 3.0)  # the old step 5 or the new one, never none
    # the next save (the restarted job's) recovers and commits cleanly
    checkpoint.save({"model": _model(4.0)}, tmp_path, 5)
    assert sorted(os.listdir(tmp_path)) == ["step-00000004", "step-00000005"]
    assert _loaded_value(checkpoint.latest(tmp_path)) == 4.0


def test_step_numbers_past_eight_digits_are_found_and_pruned(tmp_path: Path) -> None:
    for step in (99_999_999, 100_000_000, 100_000_001):
        checkpoint.save({"model": _model(float(step % 7))}, tmp_path, step, keep=2)
    assert checkpoint.latest(tmp_path) == tmp_path / "step-100000001"
    assert sorted(os.listdir(tmp_path)) == ["step-100000000", "step-100000001"]  # 99,999,999 is the oldest
    m = _model(0.0)
    assert checkpoint.load({"model": m}, tmp_path / "step-100000000") == 100_000_000


def test_checkpoints_are_private_unless_the_group_is_asked_for(tmp_path: Path) -> None:
    for group_, dmode, fmode in ((False, 0o700, 0o600), (True, 0o750, 0o640)):
        root = tmp_path / f"g{group_}"
        path = checkpoint.save({"model": _model(1.0)}, root, 1, group=group_)
        assert root.stat().st_mode & 0o777 == dmode and path.stat().st_mode & 0o777 == dmode
        files = [Path(d) / f for d, _, fs in os.walk(path) for f in fs]
        assert files and {f.stat().st_mode & 0o777 for f in files} == {fmode}


def test_a_checkpoint_others_could_change_is_not_loaded(tmp_path: Path) -> None:
    path = checkpoint.save({"model": _model(1.0)}, tmp_path, 3)
    path.chmod(0o777)
    with pytest.warns(UserWarning, match="passing over"):
        assert checkpoint.latest(tmp_path) is None
    with pytest.raises(checkpoint.CheckpointError, match="refusing to load.*lets others write"):
        checkpoint.load({"model": _model(0.0)}, path)
