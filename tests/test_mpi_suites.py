"""Run every ``tests/mpi/test_*.py`` file under ``mpiexec`` at its rank counts, launched as users launch.

Each file there is an ordinary pytest module executed by every rank (they call
collectives, so every rank runs the same tests in the same order).  A file names
its rank counts with a line ``MPI_RANKS = (2, 4)`` (the default), may raise its
time limit with ``MPI_TIMEOUT = 240`` (seconds, default 180), and may ask for extra
runs with ``MPI_VARIANTS = ("rank-order", "mpich")``: under Open MPI with a
non-default ``--map-by``/``--rank-by`` at its largest rank count (local rank > rank,
checked from the ranks' printed mapping), and under the MPICH of ``$VENV/mpich`` at
2 ranks and at its largest count.  `make test` runs each file at 2 ranks (plain and
MPICH); the other counts and the rank order are `make test-all`'s.
A hung job is killed at the limit and reported as a failure, with every rank's
Python stacks, never left running.

One file, one rank count, one test:  ``python tests/_mpijob.py -n 3 tests/mpi/test_x.py::test_y``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _mpijob import FAULT_INJECTION, inner_pytest_argv, run_mpi
from _skips import accepted

MPI_DIR = Path(__file__).parent / "mpi"
DEFAULT_RANKS = (2, 4)
DEFAULT_TIMEOUT = 180.0
OTHER_RUNS = pytest.mark.full("the MPI suites at their other rank counts and launch orders")


def _setting(text: str, name: str) -> str | None:
    match = re.search(rf"^{name}\s*=\s*(.+)$", text, re.MULTILINE)
    return match.group(1).split("#")[0].strip() if match else None


def _runs(ranks: tuple[int, ...], variants: list[str]) -> list[tuple[int, str, bool]]:
    """(ranks, variant, first tier?) of each run of a file.  The first tier (`make test`) runs a file at 2 ranks
    (or its smallest count, where 2 is not among them), under the MPICH variant there too; every other count, the
    MPICH variant at the largest and the rank-order variant are the second tier's (`make test-all`)."""
    first = 2 if 2 in ranks else min(ranks)
    runs = [(n, "plain", n == first) for n in ranks]
    for variant in variants:
        if variant == "rank-order":
            runs.append((max(3, max(ranks)), variant, False))
        else:
            runs += [(n, variant, n == first) for n in sorted({first, max(ranks)})]
    return runs


def _cases() -> list:
    cases = []
    for path in sorted(MPI_DIR.glob("test_*.py")):
        text = path.read_text()
        ranks_src = _setting(text, "MPI_RANKS")
        ranks = tuple(int(n) for n in re.findall(r"\d+", ranks_src)) if ranks_src else DEFAULT_RANKS
        timeout_src = _setting(text, "MPI_TIMEOUT")
        timeout = float(timeout_src) if timeout_src else DEFAULT_TIMEOUT
        variants = re.findall(r"[\w-]+", _setting(text, "MPI_VARIANTS") or "")
        for n, variant, first in _runs(ranks, variants):
            suffix = "" if variant == "plain" else f"-{variant}"
            cases.append(pytest.param(path, n, timeout, variant, id=f"{path.stem}-np{n}{suffix}",
                                      marks=() if first else OTHER_RUNS))
    return cases


def rank_map(out: str) -> dict[int, int]:
    """rank -> local rank, from the lines tests/mpi/conftest.py prints at the start of a job."""
    return {int(r): int(lr) for r, lr in re.findall(r"TORCHHPC-RANK-MAP rank=(\d+) local_rank=(\d+)", out)}


@pytest.mark.parametrize(("path", "nprocs", "timeout", "variant"), _cases())
def test_mpi_suite(path: Path, nprocs: int, timeout: float, variant: str) -> None:
    res = run_mpi(nprocs, inner_pytest_argv(str(path)), timeout, variant=variant)
    if res.returncode != 0:
        pytest.fail(f"{path.name} failed at {nprocs} ranks ({variant}, exit {res.returncode}):\n"
                    f"{res.stdout[-20000:]}")
    passed, skips = inner_outcome(res.stdout)
    assert passed, f"no test passed in {path.name}:\n{res.stdout[-5000:]}"
    print(f"{path.name} np{nprocs} {variant}: {passed} passed, {len(skips)} skipped")
    for reason in skips:
        print(f"  skipped: {reason}")
    mapping = rank_map(res.stdout)
    assert sorted(mapping) == list(range(nprocs)), f"ranks did not report their mapping:\n{res.stdout[-3000:]}"
    print(f"{path.name} np{nprocs} {variant}: rank -> local rank {mapping}")
    if variant == "rank-order":
        assert any(lr > r for r, lr in mapping.items()), f"the rank order is the default one: {mapping}"
    if variant == "mpich":
        assert "MPICH" in res.stdout, "the job did not run on MPICH"
    unmet = [r for r in skips if not accepted(r)]
    if unmet:  # an inner skip is never counted as a pass: the file's run is reported skipped, naming them
        pytest.skip(f"{len(unmet)} of {passed + len(skips)} tests of {path.name} skipped at {nprocs} ranks: "
                    + "; ".join(sorted(set(unmet))))


def inner_outcome(out: str) -> tuple[int, list[str]]:
    """(tests passed, the reason of each test skipped) of an inner run, from its summary (``-rs``).  Every rank
    runs the same tests and prints the same summary, so each ``SKIPPED [n] where: reason`` line counts once."""
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)  # pytest colours its summary where it thinks a terminal reads it
    found = re.search(r"(\d+) passed", out)
    groups = dict(((where, reason), int(n)) for n, where, reason in
                  re.findall(r"^SKIPPED \[(\d+)\] ([^:\s]+:\d+): (.*)$", out, re.MULTILINE))
    return (int(found.group(1)) if found else 0), [reason for (_, reason), n in groups.items() for _ in range(n)]


@FAULT_INJECTION
def test_stacks_dumped_before_a_hung_job_is_killed(tmp_path: Path) -> None:
    """A job that hangs is killed only after every rank dumped its Python stacks into the report."""
    hang = tmp_path / "test_hang.py"
    hang.write_text("import time\n\n\ndef test_waits_forever_in_a_named_function():\n"
                    "    def stuck_here_on_purpose():\n        time.sleep(3600)\n\n    stuck_here_on_purpose()\n")
    (tmp_path / "conftest.py").write_text((MPI_DIR / "conftest.py").read_text())
    with pytest.raises(pytest.fail.Exception) as info:
        run_mpi(2, inner_pytest_argv(str(hang), rootdir=str(tmp_path)), timeout=20.0)
    report = str(info.value)
    ranks = [line for line in Path("/proc").glob("[0-9]*/cmdline")
             if str(hang) in line.read_bytes().decode(errors="replace")]
    assert not ranks, "a hung rank outlived the kill"
    assert "did not finish in 20s" in report
    assert report.count("in stuck_here_on_purpose") >= 2, report[-4000:]  # one per rank
    assert "most recent call first" in report


_ONE_PASS_ONE_SKIP = """import pytest


def test_runs():
    assert True


def test_needs_what_is_not_here():
    pytest.skip("no such library here")


def test_for_other_rank_counts():
    pytest.skip("not at this rank count: needs 7 ranks")
"""


def test_an_inner_skip_is_reported_never_counted_as_a_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An inner file with one passing and two skipped tests: the harness sees 1 passed and both reasons, and only
    the structural one is accepted (the other makes the file's run a skip naming it)."""
    monkeypatch.setenv("TORCHHPC_TEST_STRICT", "0")  # the inner job inherits it: here its skips must stay skips
    inner = tmp_path / "test_inner.py"
    inner.write_text(_ONE_PASS_ONE_SKIP)
    (tmp_path / "conftest.py").write_text((MPI_DIR / "conftest.py").read_text())
    res = run_mpi(2, inner_pytest_argv(str(inner), rootdir=str(tmp_path)), timeout=120.0)
    assert res.returncode == 0, res.stdout[-3000:]
    passed, skips = inner_outcome(res.stdout)
    assert passed == 1 and sorted(skips) == ["no such library here", "not at this rank count: needs 7 ranks"], skips
    assert [accepted(r) for r in sorted(skips)] == [False, True]


def test_in_ci_a_skip_of_what_ci_provides_fails(tmp_path: Path) -> None:
    """TORCHHPC_TEST_STRICT=1 (CI): the library skip fails the run, the structural and GPU skips stay skips."""
    gpu = "\n\ndef test_gpu():\n    pytest.skip('no CUDA device')\n"
    (tmp_path / "test_inner.py").write_text(_ONE_PASS_ONE_SKIP + gpu)
    (tmp_path / "conftest.py").write_text("from _skips import make_strict\nimport pytest\n\n\n"
                                          "@pytest.hookimpl(hookwrapper=True)\n"
                                          "def pytest_runtest_makereport(item, call):\n"
                                          "    make_strict((yield).get_result())\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    for strict, want in (("0", "1 passed, 3 skipped"), ("1", "1 failed, 1 passed, 2 skipped")):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                              env={**env, "TORCHHPC_TEST_STRICT": strict}, capture_output=True, text=True,
                              timeout=120)
        assert want in proc.stdout, proc.stdout
    assert "skipped where CI provides what it needs" in proc.stdout and "no such library here" in proc.stdout


def main() -> None:  # pragma: no cover - `python tests/test_mpi_suites.py` lists the cases
    for case in _cases():
        print(case.id)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
