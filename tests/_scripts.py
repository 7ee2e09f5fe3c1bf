"""Load a repository script (an example, a benchmark, tests/all_reduce_test.py) as a module, for in-process tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """Import the file at ``ROOT/relative_path`` as a module named after its stem, without running ``__main__``."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
