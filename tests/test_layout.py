"""The package's layers import downwards only: the runtime (torchhpc.runtime) imports no capability and no tool,
and a capability (accl, rehearsal, braid, chunkstore, checkpoint) imports no tool or entry point (launcher, cli,
doctor, jobscript, frtrace, bench, mpi_upstream).  Read from every module's import statements, lazy ones too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "torchhpc"
CAPABILITIES = {"accl", "rehearsal", "braid", "chunkstore", "checkpoint"}
TOOLS = {"launcher", "cli", "doctor", "bindings", "jobscript", "submit", "frtrace", "bench", "mpi_upstream"}


def _imported(path: Path) -> set[str]:
    """The torchhpc subpackages or modules (first name below torchhpc) that ``path`` imports."""
    here = path.relative_to(PKG.parent).with_suffix("").parts  # ("torchhpc", "accl", "group")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(here[: len(here) - node.level]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "torchhpc" and len(parts) > 1:
                found.add(parts[1])
    return found


def _layer(part: str) -> str:
    return "runtime" if part == "runtime" else "capability" if part in CAPABILITIES else "tool"


@pytest.mark.parametrize("layer", ["runtime", "capability"])
def test_each_layer_imports_only_the_layers_below(layer: str) -> None:
    allowed = {"runtime"} if layer == "runtime" else {"runtime", "capability"}
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        top = path.relative_to(PKG).parts[0].removesuffix(".py")
        if _layer(top) != layer:
            continue
        for name in sorted(_imported(path)):
            if name != top and _layer(name) not in allowed:
                bad.append(f"{path.relative_to(PKG)} imports torchhpc.{name}")
    assert not bad, "\n".join(bad)


def test_the_scan_sees_lazy_and_relative_imports() -> None:
    """The scan is not vacuous: accl's backend registration and the launcher's lazy import of it are seen."""
    assert "runtime" in _imported(PKG / "accl" / "backend.py")
    assert "accl" in _imported(PKG / "launcher.py")  # inside a function: backend="accl" registers it
    assert _layer("accl") == "capability" and _layer("launcher") == "tool"
