"""The native engines: extension modules `make native` builds, imported on demand or named as missing.

Each engine is one pybind11 module built into ``$NATIVE_PREFIX/python`` (on ``sys.path`` through a
``.pth`` file in the environment).  ``TORCHHPC_NATIVE_PREFIX`` names another prefix (e.g. one built with
``make native NATIVE_PREFIX=...`` for several environments); its ``python/`` is searched first.
:data:`ENGINES` is the table :func:`load` and ``torchhpc doctor`` read: one row per engine.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .errors import EngineUnavailableError

__all__ = ["ENGINES", "NativeEngine", "load", "native_prefix", "probe"]


@dataclass(frozen=True)
class NativeEngine:
    """One native engine: the module that provides it, the make target that builds it, what uses it."""

    name: str
    module: str
    make_target: str
    used_by: str


ENGINES: dict[str, NativeEngine] = {
    "thallium": NativeEngine("thallium", "_torchhpc_thallium", "make native-mochi",
                             "RehearsalBuffer(transport='thallium')"),
    "xbraid": NativeEngine("xbraid", "_torchhpc_xbraid", "make native-xbraid",
                           "torchhpc.braid engine='xbraid'"),
}


def native_prefix() -> Path:
    """Where ``make native`` installed: ``TORCHHPC_NATIVE_PREFIX``, else ``<environment>/native``."""
    env = os.environ.get("TORCHHPC_NATIVE_PREFIX")
    return Path(env) if env else Path(sys.prefix) / "native"


def _extend_path() -> None:
    d = str(native_prefix() / "python")
    if d not in sys.path:
        sys.path.insert(0, d)


def load(name: str) -> ModuleType:
    """Import engine ``name``'s module, or raise :class:`EngineUnavailableError` saying how to build it."""
    if name not in ENGINES:
        raise ValueError(f"no native engine {name!r}; known: {', '.join(sorted(ENGINES))}")
    eng = ENGINES[name]
    _extend_path()
    try:
        return importlib.import_module(eng.module)
    except ImportError as exc:
        raise EngineUnavailableError(
            f"the native {name} engine ({eng.used_by}) is not available: its extension module {eng.module} "
            f"does not import ({exc}); build it with `{eng.make_target}` (or `make env NATIVE=1`), or point "
            "TORCHHPC_NATIVE_PREFIX at the prefix it was built into (docs/development.md)"
        ) from exc


def probe() -> dict[str, tuple[bool, str]]:
    """For each engine: (importable, where it was loaded from or why not)."""
    out: dict[str, tuple[bool, str]] = {}
    for name, eng in ENGINES.items():
        try:
            mod = load(name)
        except EngineUnavailableError as exc:
            out[name] = (False, f"not built ({eng.make_target}): {exc.__cause__ or exc}")
        else:
            out[name] = (True, str(getattr(mod, "__file__", "?")))
    return out
