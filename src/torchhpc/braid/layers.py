"""Building blocks of layer-parallel networks: ODE steps, seeded layer construction, side-effect rules."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["ODEBlock", "LayerSpec", "takes_dt", "dropout_in_training", "dropout_error", "call_layer",
           "bn_training", "ode_step", "vjp"]

LayerSpec = Callable[[], nn.Module] | nn.Module


def takes_dt(layer: nn.Module) -> bool:
    """Whether ``layer.forward`` accepts the step size itself (then it is called as ``layer(x, dt=dt)``)."""
    try:
        return "dt" in inspect.signature(layer.forward).parameters
    except (TypeError, ValueError):
        return False


def build_layer(spec: LayerSpec, seed: int) -> nn.Module:
    """A fresh layer from a constructor (or a copy of a module), with RNG seeded by ``seed``.

    Seeding per layer makes every rank build the same weights for layer k, whatever the rank count.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(spec, nn.Module):
            return copy.deepcopy(spec)
        layer = spec()
    if not isinstance(layer, nn.Module):
        raise TypeError(f"layer constructor returned {type(layer).__name__}, not an nn.Module")
    return layer


def _bn_training(layer: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
               for m in layer.modules())


def dropout_in_training(layer: nn.Module) -> nn.Module | None:
    """The first dropout module of ``layer`` that would draw random masks (training mode, p > 0), if any."""
    for m in layer.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            return m
    return None


def dropout_error(index: int, what: str) -> ValueError:
    """Why dropout in training mode is refused inside a layer-parallel network."""
    return ValueError(
        f"layer {index} contains {what} in training mode; MGRIT evaluates each layer many times per pass "
        "and every evaluation would draw a new mask, so the iteration has no fixed point. Put dropout "
        "outside LayerParallel or call .eval() on it.")


def call_layer(layer: nn.Module, x: torch.Tensor, args: tuple, kwargs: dict,
               pure: bool = True) -> torch.Tensor:
    """Evaluate ``layer`` without side effects on BatchNorm running statistics.

    MGRIT evaluates a layer many times per pass; in training mode BatchNorm uses the batch
    statistics of each evaluation (so the step is still a function of its input) but updates
    clones of its running buffers.  The real buffers are updated once, from the converged input,
    by one call with ``pure=False`` (see :func:`bn_training`).
    """
    if not pure or not _bn_training(layer):
        return layer(x, *args, **kwargs)
    buffers = {name: b.clone() for name, b in layer.named_buffers()}
    return torch.func.functional_call(layer, buffers, (x, *args), kwargs, strict=False)


def bn_training(layer: nn.Module) -> bool:
    """Whether evaluating ``layer`` would update BatchNorm running statistics."""
    return _bn_training(layer)


class ODEBlock(nn.Module):
    """One forward-Euler step ``x + dt * layer(x)`` (or ``layer(x, dt=dt)`` when the layer takes dt)."""

    def __init__(self, layer: nn.Module, dt: float) -> None:
        super().__init__()
        self.layer = layer
        self.dt = dt
        self._takes_dt = takes_dt(layer)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return ode_step(self.layer, x, self.dt, args, kwargs, self._takes_dt, pure=False)


def ode_step(layer: nn.Module, x: torch.Tensor, dt: float, args: tuple, kwargs: dict,
             with_dt: bool, pure: bool = True) -> torch.Tensor:
    """The ODE-block update of ``x`` over a step ``dt``."""
    if with_dt:
        return call_layer(layer, x, args, {**kwargs, "dt": dt}, pure)
    return x + dt * call_layer(layer, x, args, kwargs, pure)


def vjp(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor],
        allow_unused: bool = False) -> tuple[torch.Tensor | None, ...]:
    """Vector-Jacobian product: the gradient of ``sum_i <cotangents[i], outputs[i]>`` with respect to ``inputs``.

    Taken as the gradient of a real scalar, which gives the same values bit for bit as passing
    ``grad_outputs`` (the backward of ``(o * c).sum()`` hands ``1.0 * c`` to ``o``), but spares every
    rank the sympy import (about a second) that torch performs the first time it is given
    ``grad_outputs``.  Complex outputs take the ``grad_outputs`` route.
    """
    if any(o.is_complex() for o in outputs):
        return torch.autograd.grad(list(outputs), list(inputs), list(cotangents), allow_unused=allow_unused)
    total = None
    for o, c in zip(outputs, cotangents, strict=True):
        term = (o * c).sum()
        total = term if total is None else total + term
    return torch.autograd.grad(total, list(inputs), allow_unused=allow_unused)
