"""The code base stays ruff-clean and its shell scripts shellcheck-clean (shellcheck is skipped if not installed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff not installed in this environment (make env installs it)")
    paths = [p for p in ("src", "tests", "bench", "examples", "packages") if (ROOT / p).exists()]
    res = subprocess.run([str(ruff), "check", *paths], cwd=ROOT, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (CI installs it: apt-get install shellcheck)")
    scripts = sorted({*ROOT.glob("*.sh"), *ROOT.glob("utils/**/*.sh"), ROOT / ".ci" / "run",
                      ROOT / "utils" / "vcluster" / "ssh"})
    res = subprocess.run(["shellcheck", "-x", *map(str, scripts)], cwd=ROOT, capture_output=True, text=True,
                         check=False)
    assert res.returncode == 0, res.stdout + res.stderr
