"""The README's commands, run as typed: the set-up lines are what CI runs, and the main job prints its table.

The cluster block is run as typed on the virtual cluster, under OpenPBS (tests/test_vcluster_pbs.py) and Slurm
(tests/test_vcluster.py), through `readme_cluster_lines` here.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from _stranger import VICTIM, needs_two_users, shell_as

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def bash_blocks() -> list[str]:
    """The text of each ```bash block of the README, in order."""
    return re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)


def readme_blocks() -> list[list[str]]:
    """Each ```bash block of the README as its command lines, comments cut off."""
    return [[line.split("  #")[0].strip() for line in block.splitlines() if line.strip()] for block in bash_blocks()]


def readme_cluster_lines(scheduler: str, values: dict[str, str]) -> list[str]:
    """The README's cluster block for ``scheduler``: PBS as written, Slurm from each line's ``# Slurm:`` comment;
    ``<placeholder>``s filled from ``values`` (a placeholder left unfilled fails the caller's test)."""
    lines = []
    for line in bash_blocks()[1].splitlines():
        command, _, comment = line.partition("  #")
        if scheduler == "slurm" and "Slurm:" in comment:
            command = comment.split("Slurm:", 1)[1]
        for key, value in values.items():
            command = command.replace(f"<{key}>", value)
        assert "<" not in command, f"unfilled placeholder in {command!r}"
        lines.append(command.strip())
    return lines


def test_the_set_up_lines_are_what_ci_runs() -> None:
    """The README's set-up is `make env` then `make test`; CI runs the same after `make env`, with the second tier:
    `make test-all`, which the README names beside it."""
    setup = readme_blocks()[0]
    assert setup[:3] == ["make env", "source .venv/bin/activate", "make test"], setup
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert ci.index("make test-all") > max(i for i, line in enumerate(ci) if line.startswith("make env")), ci
    assert "`make test-all`" in README.read_text()


def main_job_lines() -> str:
    """The set-up block from activating the environment on (after `make env` and `make test`), as typed."""
    lines = [line for line in bash_blocks()[0].splitlines() if line.strip()]
    assert lines[1].startswith("source .venv/bin/activate"), lines
    assert lines[-1].startswith("mpiexec -n 2 python tests/"), lines
    return "\n".join([lines[1], *lines[3:]])


def check_table(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# Out of bounds values : 0 OK" in proc.stdout and "busbw" in proc.stdout, proc.stdout
    assert "backend accl, 2 ranks" in proc.stdout, proc.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the lines as root")
def test_the_main_job_runs_as_typed_as_root() -> None:
    """As root (containers, CI): the README's own line lets Open MPI run; nothing comes from this harness."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PRTE_", "PMIX_"))}
    check_table(subprocess.run(["bash", "-c", main_job_lines()], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=300))


@needs_two_users
def test_the_main_job_runs_as_typed_as_a_user() -> None:
    """As a plain user with no capabilities, a fresh HOME and a login's PATH."""
    check_table(shell_as(VICTIM, main_job_lines()))


def test_the_readme_reads_on_one_screen_width() -> None:
    long = [line for line in README.read_text().splitlines() if len(line) > 120]
    assert not long, long
