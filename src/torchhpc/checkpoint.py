"""Checkpoints a restarted job can trust: ``torch.distributed.checkpoint`` (DCP) into ``step-<N>.partial``, renamed to
``step-<N>`` only once every rank's part and DCP's metadata are on disk.

A job killed while writing (a node lost, a walltime hit) leaves a ``.partial`` directory that :func:`latest` never
returns, so a resumed job starts from the newest checkpoint that was finished; re-saving a step moves the finished
one aside (``step-<N>.replaced``) before the new one takes its name, so a finished checkpoint exists at every
instant. The directory must be on a file system every node sees. Checkpoints are private (0700/0600; ``group=True``:
0750/0640, for a group that shares a project directory); :func:`latest` passes over and :func:`load` refuses a
directory another user owns or could write (DCP unpickles its metadata). Each rank's torch random state is saved
under its own key and restored by :func:`load`, so that a resumed run draws the same numbers as one never stopped
(same world size).

    ckpt = checkpoint.latest(root)
    step = checkpoint.load({"model": model, "optim": opt}, ckpt) if ckpt else 0
    ...
    checkpoint.save({"model": model, "optim": opt}, root, step)
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .runtime import private
from .runtime.errors import TorchhpcError

__all__ = ["CheckpointError", "latest", "load", "save"]

_DONE = re.compile(r"step-(\d{8,})")  # {step:08d}: eight digits or more
_REPLACED = re.compile(r"step-(\d{8,})\.replaced")  # a finished one moved aside while its step is re-saved


class CheckpointError(TorchhpcError):
    """A checkpoint could not be written, committed or read; raised on every rank alike."""


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest finished checkpoint under ``root`` that is this user's (``.partial`` ones never count), or
    None.  A directory another user owns or could write is passed over with a warning."""
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, bool, Path] | None = None
    for step, p in _step_dirs(root):
        if not (p / ".metadata").is_file():
            continue
        try:
            private.check_trusted(p)
        except private.UnsafePathError as exc:
            warnings.warn(f"checkpoint: passing over {exc}", stacklevel=2)
            continue
        key = (step, _DONE.fullmatch(p.name) is not None, p)  # the finished name before one moved aside
        best = max(best, key) if best else key
    return best[2] if best else None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every finished or moved-aside checkpoint under ``root`` with its step, oldest first."""
    out = []
    for p in root.iterdir():
        m = _DONE.fullmatch(p.name) or _REPLACED.fullmatch(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def _commit_steps(root: Path, partial: Path, final: Path, keep: int) -> list[Callable[[], None]]:
    """Commit ``partial`` as ``final``, one rename at a time, so that a crash between any two leaves a
    finished checkpoint of this step (the old one, moved aside, or the new one): its steps in order."""
    aside = root / f"{final.name}.replaced"

    def move_old_aside() -> None:
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)

    def drop_old() -> None:
        shutil.rmtree(aside, ignore_errors=True)

    def prune() -> None:
        steps = sorted({step for step, _ in _step_dirs(root)})
        for step, p in _step_dirs(root):
            if step in steps[:-keep]:
                shutil.rmtree(p, ignore_errors=True)

    return [move_old_aside, lambda: os.rename(partial, final), lambda: _fsync_dir(root), drop_old, prune]


def save(state: dict[str, Any], root: str | os.PathLike[str], step: int, *, keep: int = 2,
         group: bool = False) -> Path:
    """Write ``state`` as the checkpoint of ``step`` under ``root`` (collective) and keep the newest ``keep``.

    ``state`` maps names to modules, optimizers (with ``"model"`` beside them) or state-dict values; the
    optimizer's state is taken through DCP's ``get_state_dict`` so that DDP- and FSDP-wrapped models save the
    same keys.  ``group``: readable by the user's group (0750/0640) instead of the user alone (0700/0600).
    Returns the committed directory."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if step < 0 or keep < 1:
        raise ValueError(f"step must be >= 0 and keep >= 1, got step={step}, keep={keep}")
    root = Path(root)
    final, partial = root / f"step-{step:08d}", root / f"step-{step:08d}.partial"
    rank = dist.get_rank()

    dir_mode, file_mode = (0o750, 0o640) if group else (0o700, 0o600)

    def prepare() -> None:
        if not root.exists():
            root.mkdir(parents=True, mode=dir_mode)
        shutil.rmtree(partial, ignore_errors=True)  # left by a job killed while writing this step
        aside = root / f"{final.name}.replaced"
        if aside.exists() and not final.exists():
            os.rename(aside, final)  # killed while re-saving this step, between the two renames
        os.mkdir(partial, dir_mode)

    def commit() -> None:
        for folder, _, files in os.walk(partial):  # DCP writes with the process's umask
            os.chmod(folder, dir_mode)
            for name in files:
                os.chmod(os.path.join(folder, name), file_mode)
        for step_ in _commit_steps(root, partial, final, keep):
            step_()

    flat = _flat(state, rank)  # bad arguments are refused before anything is written
    _on_rank0(prepare, f"could not prepare {partial}")
    dcp.save(flat, checkpoint_id=partial)  # DCP raises on every rank if any rank failed
    _on_rank0(commit, f"could not commit {partial}")
    return final


def load(state: dict[str, Any], path: str | os.PathLike[str]) -> int:
    """Load the checkpoint at ``path`` into ``state`` in place (collective; same keys as :func:`save` got) and
    restore this rank's random state; returns the checkpoint's step."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    match = _DONE.fullmatch(path.name) or _REPLACED.fullmatch(path.name)
    if match is None:
        raise CheckpointError(f"{path} is not a finished checkpoint (a step-NNNNNNNN directory)")
    try:
        private.check_trusted(path)
        private.check_trusted(path / ".metadata")
    except private.UnsafePathError as exc:
        raise CheckpointError(f"refusing to load {path}: {exc}") from None
    rank = dist.get_rank()
    flat = _flat(state, rank)
    try:
        dcp.load(flat, checkpoint_id=path)
    except Exception as exc:
        raise CheckpointError(f"could not load {path}: {exc}") from exc
    model = state.get("model")
    optims = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    if isinstance(model, torch.nn.Module):
        set_state_dict(model, optims, model_state_dict=flat["model"],
                       optim_state_dict=flat["optim"] if optims else {})
    torch.set_rng_state(flat[f"rng_rank{rank}"])
    return int(match.group(1))


def _flat(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """``state`` as DCP takes it: the model's and optimizers' state dicts, other values as given, and this
    rank's random state under a key of its own."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = state.get("model")
    optims = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
    if optims and not isinstance(model, torch.nn.Module):
        raise CheckpointError("an optimizer is saved only beside its module under the key 'model'")
    if len(optims) > 1:
        raise CheckpointError(f"one optimizer per checkpoint, got {optims}")
    flat = {k: v for k, v in state.items() if k not in ("model", *optims)}
    if isinstance(model, torch.nn.Module):
        flat["model"], optim_sd = get_state_dict(model, [state[k] for k in optims])
        if optims:
            flat["optim"] = optim_sd
    elif model is not None:
        flat["model"] = model
    flat[f"rng_rank{rank}"] = torch.get_rng_state()
    return flat


def _on_rank0(action, what: str) -> None:  # noqa: ANN001
    """Run ``action`` on rank 0 and raise its failure on every rank (collective)."""
    import torch.distributed as dist

    error = [None]
    if dist.get_rank() == 0:
        try:
            action()
        except OSError as exc:
            error = [f"{what}: {exc}"]
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointError(error[0])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
