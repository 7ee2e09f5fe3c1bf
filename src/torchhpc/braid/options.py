"""MGRIT algorithm settings shared by :func:`torchhpc.braid.mgrit.solve` and the layer-parallel modules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["MGRITOptions", "relax_sweeps"]

_RELAX_NAMES = {"F": 0, "FCF": 1, "FCFCF": 2}


def relax_sweeps(relax: str | int) -> int:
    """Number of CF sweeps after the first F-relaxation: ``"F"`` -> 0, ``"FCF"`` -> 1, an int as given."""
    if isinstance(relax, str):
        key = relax.upper()
        if key not in _RELAX_NAMES:
            raise ValueError(f"relax must be 'F', 'FCF', 'FCFCF' or a number of CF sweeps, got {relax!r}")
        return _RELAX_NAMES[key]
    if int(relax) != relax or relax < 0:
        raise ValueError(f"number of CF relaxation sweeps must be an int >= 0, got {relax!r}")
    return int(relax)


def _per_level(value: int | Sequence[int], name: str) -> list[int]:
    vals = [value] if isinstance(value, int | str) else list(value)
    if not vals:
        raise ValueError(f"{name} must not be empty")
    return vals


@dataclass
class MGRITOptions:
    """XBraid-style knobs.  Per-level lists repeat their last entry on deeper levels.

    cfactor: coarsening factor per level (>= 2).  relax: CF sweeps per level after the first
    F-relaxation ("F" = 0, "FCF" = 1).  tol: absolute stop on the space-time residual 2-norm;
    rtol: relative to the first iteration's residual (0 = off).  skip_downcycle: XBraid's
    ``braid_SetSkip`` (torchbraid's ``setSkipDowncycle``): the first cycle does no relaxation or
    restriction on the way down; the initial guess is injected to every level and the cycle starts
    with the coarsest solve.  weight_c: C-relaxation weight.  min_coarse: smallest coarse grid.
    """

    max_levels: int = 10
    cfactor: list[int] = field(default_factory=lambda: [2])
    relax: list[int] = field(default_factory=lambda: [1])
    cycle: str = "V"
    tol: float = 1e-7
    rtol: float = 0.0
    max_iter: int = 100
    nested_iteration: bool = True
    skip_downcycle: bool = False
    weight_c: float = 1.0
    min_coarse: int = 2
    print_level: int = 0

    @classmethod
    def build(cls, *, max_levels: int = 10, cfactor: int | Sequence[int] = 2,
              relax: str | int | Sequence[str | int] = "FCF", cycle: str = "V", tol: float = 1e-7,
              rtol: float = 0.0, max_iter: int = 100, nested_iteration: bool = True,
              skip_downcycle: bool = False, weight_c: float = 1.0, min_coarse: int = 2,
              print_level: int = 0) -> MGRITOptions:
        """Validate user-facing arguments into options."""
        opts = cls(max_levels=max_levels, cfactor=[int(c) for c in _per_level(cfactor, "cfactor")],
                   relax=[relax_sweeps(r) for r in _per_level(relax, "relax")], cycle=cycle, tol=tol,
                   rtol=rtol, max_iter=max_iter, nested_iteration=nested_iteration,
                   skip_downcycle=skip_downcycle, weight_c=weight_c, min_coarse=min_coarse,
                   print_level=print_level)
        opts.validate()
        return opts

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        if int(self.max_levels) != self.max_levels or self.max_levels < 1:
            raise ValueError(f"max_levels must be an int >= 1, got {self.max_levels!r}")
        if any(c < 2 for c in self.cfactor):
            raise ValueError(f"cfactor must be >= 2 on every level, got {self.cfactor}")
        if self.cycle not in ("V", "F"):
            raise ValueError(f"cycle must be 'V' or 'F', got {self.cycle!r}")
        if self.tol < 0 or self.rtol < 0:
            raise ValueError(f"tolerances must be >= 0, got tol={self.tol}, rtol={self.rtol}")
        if int(self.max_iter) != self.max_iter or self.max_iter < 1:
            raise ValueError(f"max_iter must be an int >= 1, got {self.max_iter!r}")
        if not 0.0 < self.weight_c <= 2.0:
            raise ValueError(f"weight_c must be in (0, 2], got {self.weight_c}")
        if self.min_coarse < 1:
            raise ValueError(f"min_coarse must be >= 1, got {self.min_coarse}")

    def sweeps(self, lvl: int) -> int:
        return self.relax[min(lvl, len(self.relax) - 1)]
