""".ci/debian-packages holds every Debian package the scripts it serves name: a package missing there makes CI
skip (or fail) what a user's machine would run."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# names a script gives that CI gets through another listed package
PROVIDED_BY = {"gcc": "build-essential", "make": "make", "tcl-dev": "tk-dev"}


def ci_packages() -> set[str]:
    lines = (ROOT / ".ci" / "debian-packages").read_text().splitlines()
    return {line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()}


def named_in(script: Path) -> dict[str, set[str]]:
    """The packages a script's header names, by phase (``# build: ...``, ``# run: ...``)."""
    out: dict[str, set[str]] = {}
    for phase, words in re.findall(r"^# (build|run): (.*)$", script.read_text(), re.MULTILINE):
        out.setdefault(phase, set()).update(words.split())
    return out


def test_openpbs_build_and_run_time_packages_are_installed_by_ci() -> None:
    named = named_in(ROOT / "utils" / "vcluster" / "build_openpbs.sh")
    assert {"postgresql", "sendmail-bin"} <= named.get("run", set()), named
    assert len(named.get("build", ())) > 10, named
    listed = ci_packages()
    missing = sorted(p for phase in named.values() for p in phase if PROVIDED_BY.get(p, p) not in listed)
    assert not missing, f".ci/debian-packages lacks {missing}, which utils/vcluster/build_openpbs.sh needs"


def test_tk_dev_brings_tcl_dev() -> None:
    """The one indirect name above: tk-dev depends on tcl-dev (so the Tcl headers the build checks for come)."""
    proc = subprocess.run(["apt-cache", "depends", "tk-dev"], capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.skip("no apt-cache here: the list is for Debian")
    assert re.search(r"^\s*Depends: tcl-dev$", proc.stdout, re.MULTILINE), proc.stdout
