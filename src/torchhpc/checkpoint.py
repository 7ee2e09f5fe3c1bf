"""Checkpoints a restarted job can trust: ``torch.distributed.checkpoint`` (DCP) into ``step-<N>.partial``,
renamed to ``step-<N>`` only once every rank's part and DCP's metadata are on disk.

A job killed while writing (a node lost, a walltime hit) leaves a ``.partial`` directory that :func:`latest`
never returns, so a resumed job starts from the newest checkpoint that was finished.  The directory must be on a
file system every node sees.  Each rank's torch random state is saved under its own key and restored by
:func:`load`, so that a resumed run draws the same numbers as one never stopped (same world size).

    ckpt = checkpoint.latest(root)
    step = checkpoint.load({"model": model, "optim": opt}, ckpt) if ckpt else 0
    ...
    checkpoint.save({"model": model, "optim": opt}, root, step)
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from .errors import TorchhpcError

__all__ = ["CheckpointError", "latest", "load", "save"]

_DONE = re.compile(r"step-(\d{8})")


class CheckpointError(TorchhpcError):
    """A checkpoint could not be written, committed or read; raised on every rank alike."""


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest finished checkpoint under ``root`` (``.partial`` ones never count), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if _DONE.fullmatch(p.name) and (p / ".metadata").is_file()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def save(state: dict[str, Any], root: str | os.PathLike[str], step: int, *, keep: int = 2) -> Path:
    """Write ``state`` as the checkpoint of ``step`` under ``root`` (collective) and keep the newest ``keep``.

    ``state`` maps names to modules, optimizers (with ``"model"`` beside them) or state-dict values; the
    optimizer's state is taken through DCP's ``get_state_dict`` so that DDP- and FSDP-wrapped models save the
    same keys.  Returns the committed directory."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if step < 0 or keep < 1:
        raise ValueError(f"step must be >= 0 and keep >= 1, got step={step}, keep={keep}")
    root = Path(root)
    final, partial = root / f"step-{step:08d}", root / f"step-{step:08d}.partial"
    rank = dist.get_rank()

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a job killed while writing this step

    def commit() -> None:
        shutil.rmtree(final, ignore_errors=True)  # a finished one of the same step: this one replaces it
        os.rename(partial, final)
        _fsync_dir(root)
        for old in sorted((p for p in root.iterdir() if _DONE.fullmatch(p.name)), key=lambda p: p.name)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    _on_rank0(prepare, f"could not prepare {partial}")
    dcp.save(_flat(state, rank), checkpoint_id=partial)  # DCP raises on every rank if any rank failed
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
    match = _DONE.fullmatch(path.name)
    if match is None:
        raise CheckpointError(f"{path} is not a finished checkpoint (a step-NNNNNNNN directory)")
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
