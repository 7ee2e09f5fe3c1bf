"""The code base stays ruff-clean, no Python function is above radon grade C (cyclomatic complexity <= 20), accl's
C++ backend keeps its shape (lizard: no function over 60 lines or cyclomatic complexity 15, a bounded size), and
its shell scripts stay shellcheck-clean (shellcheck is skipped if not installed)."""

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


def test_complexity_at_most_grade_c() -> None:
    """The bound `make lint` enforces: radon grade D and worse (complexity > 20) nowhere in src/torchhpc."""
    radon = Path(sys.executable).with_name("radon")
    if not radon.exists():
        pytest.skip("radon not installed in this environment (make env installs it)")
    res = subprocess.run([str(radon), "cc", "--min", "D", "--show-complexity", "src/torchhpc"], cwd=ROOT,
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0 and not res.stdout.strip(), "functions above grade C:\n" + res.stdout + res.stderr
    make = subprocess.run(["make", "-n", "lint"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert "radon cc --min D" in make.stdout, "make lint no longer runs the complexity bound"


# accl's csrc in lizard's NLOC.  The .cpp files alone grew from 1,736 to 2,245 under a bound raised seven times to
# fit them (to 2,250); the whole csrc (.cpp and .hpp) was 2,710 when it was first counted.  Both bounds sit where the
# code came back to and are only ever lowered: the goal for the whole is 2,000, and growth pays for itself by
# deletion (what the lines beyond upstream's ProcessGroupMPI.cpp buy: docs/development.md).
CSRC_CPP_NLOC_BOUND = 1893
CSRC_NLOC_BOUND = 2322


def test_accl_backend_shape() -> None:
    """No function of accl's C++ backend over 60 lines or cyclomatic complexity 15 (PyTorch's MPI backend has
    none above 10), and the whole within its bound."""
    lizard = Path(sys.executable).with_name("lizard")
    if not lizard.exists():
        pytest.skip("lizard not installed in this environment (make env installs it)")
    csrc = ROOT / "src/torchhpc/accl/csrc"
    files = sorted(str(p) for p in [*csrc.glob("*.cpp"), *csrc.glob("*.hpp")])
    res = subprocess.run([str(lizard), "--csv", *files], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    rows = [line.split(",") for line in res.stdout.splitlines() if line.strip()]
    # lizard's CSV: NLOC, CCN, tokens, parameters, length, location, file, name, long name, start, end
    too_big = [f"{r[7]} ({r[6].rsplit('/', 1)[-1]}): {r[4]} lines, CCN {r[1]}" for r in rows
               if int(r[4]) > 60 or int(r[1]) > 15]
    assert not too_big, "functions over 60 lines or CCN 15:\n" + "\n".join(too_big)
    total = sum(int(r[0]) for r in rows)
    assert total > 0, res.stdout
    for which, bound in ((files, CSRC_NLOC_BOUND), ([f for f in files if f.endswith(".cpp")], CSRC_CPP_NLOC_BOUND)):
        summary = subprocess.run([str(lizard), *which], capture_output=True, text=True, check=False).stdout
        nloc = int(summary.strip().splitlines()[-1].split()[0])
        assert nloc <= bound, f"accl's csrc ({len(which)} files) is {nloc} NLOC, over its bound of {bound}"


def test_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (CI installs it: apt-get install shellcheck)")
    scripts = sorted({*ROOT.glob("*.sh"), *ROOT.glob("utils/**/*.sh"), ROOT / ".ci" / "run",
                      ROOT / "utils" / "vcluster" / "ssh"})
    res = subprocess.run(["shellcheck", "-x", *map(str, scripts)], cwd=ROOT, capture_output=True, text=True,
                         check=False)
    assert res.returncode == 0, res.stdout + res.stderr
