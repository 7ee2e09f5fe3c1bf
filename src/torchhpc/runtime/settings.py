"""Every ``TORCHHPC_*`` variable torchhpc parses, in one table: its kind, its range and what it sets.

A value out of range or of the wrong kind is a :class:`SettingError` naming the variable and what it takes, at
the first read and in ``torchhpc doctor`` (which checks them all with :func:`problems`), never a bare ``int()``
traceback nor a value quietly accepted.  Unset or empty means the default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import TorchhpcError

__all__ = ["SettingError", "Setting", "SETTINGS", "get", "problems"]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SettingError(TorchhpcError, ValueError):
    """A ``TORCHHPC_*`` variable holds a value torchhpc cannot take; the message names it."""


@dataclass(frozen=True)
class Setting:
    """One variable: ``kind`` is ``int``, ``float``, ``bool`` or ``choice``; ``low``/``high`` bound a number
    (inclusive), ``choices`` a choice (compared in lower case)."""

    name: str
    kind: str
    default: Any
    what: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()

    def takes(self) -> str:
        """What a valid value looks like, in words."""
        if self.kind == "bool":
            return "1/0, true/false, yes/no or on/off"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        noun = "a whole number" if self.kind == "int" else "a number"
        bounds = [f">= {self.low:g}" if self.low is not None else "",
                  f"<= {self.high:g}" if self.high is not None else ""]
        return " ".join([noun, " and ".join(b for b in bounds if b)]).strip()

    def in_range(self, value: float) -> bool:
        """Whether a number lies within ``low`` and ``high`` (each inclusive, None: unbounded)."""
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)

    def parse(self, raw: str) -> Any:
        """``raw`` as this setting's value; :class:`SettingError` naming the variable otherwise."""
        text = raw.strip()
        try:
            if self.kind == "bool":
                if text.lower() not in _TRUE + _FALSE:
                    raise ValueError
                return text.lower() in _TRUE
            if self.kind == "choice":
                if text.lower() not in self.choices:
                    raise ValueError
                return text.lower()
            value = int(text) if self.kind == "int" else float(text)
            if (self.kind == "float" and not math.isfinite(value)) or not self.in_range(value):
                raise ValueError
            return value
        except ValueError:
            raise SettingError(f"{self.name}={raw!r}: {self.what} takes {self.takes()}") from None


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("TORCHHPC_ACCL_ENGINE", "choice", "mpi", "accl's engine", choices=("mpi", "accl")),
    Setting("TORCHHPC_ACCL_MAX_SEGMENT_BYTES", "int", None, "accl's largest engine call", low=8),
    Setting("TORCHHPC_ACCL_RING_MIN_BYTES", "int", None, "accl's ring threshold", low=0),
    Setting("TORCHHPC_ACCL_SPIN_US", "int", None, "accl's spin before yielding", low=0, high=10_000_000),
    Setting("TORCHHPC_ACCL_FLIGHT_STACKS", "bool", False, "accl's Python stacks in flight records"),
    Setting("TORCHHPC_ACCL_START_PORT", "int", 5500, "the ACCL engine's first port", low=1, high=65535),
    Setting("TORCHHPC_ACCL_BUFSIZE", "int", 1 << 20, "the ACCL engine's buffer size", low=1),
    Setting("TORCHHPC_ACCL_PROTOCOL", "choice", "tcp", "the ACCL engine's protocol", choices=("tcp", "udp", "rdma")),
    Setting("TORCHHPC_RANKS_PER_NODE", "int", None, "chunkstore's ranks per node", low=1),
    Setting("TORCHHPC_BRAID_TIMEOUT", "float", None, "braid's deadline in seconds", low=1e-3),
    Setting("TORCHHPC_CUDA_AWARE_MPI", "bool", None, "whether MPI takes CUDA buffers"),
    Setting("TORCHHPC_MPI_FAMILY", "choice", None, "the MPI family", choices=("openmpi", "mpich")),
    Setting("TORCHHPC_BIND", "bool", False, "binding a rank the launcher left on every core to its share"),
)}


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of setting ``name`` in ``env`` (default ``os.environ``): parsed and checked, or its default."""
    setting = SETTINGS[name]
    raw = (os.environ if env is None else env).get(name)
    return setting.default if raw is None or raw.strip() == "" else setting.parse(raw)


def problems(env: Mapping[str, str] | None = None) -> list[str]:
    """Every set ``TORCHHPC_*`` variable of the table whose value cannot be taken, one message each."""
    out = []
    for name in SETTINGS:
        try:
            get(name, env)
        except SettingError as exc:
            out.append(str(exc))
    return out
