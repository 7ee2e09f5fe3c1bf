"""Shared pytest set-up: tests import torchhpc from src/ even without `make env`'s editable install; the two
tiers (`make test`, `make test-all`) and what the first leaves out, said at the end; the one-rank accl group
fixture."""

import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


import pytest  # noqa: E402
from _skips import make_strict  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001, ARG001
    """In CI (TORCHHPC_TEST_STRICT=1) a skip of something CI provides is a failure (tests/_skips.py)."""
    outcome = yield
    make_strict(outcome.get_result())


# Tests marked ``full`` (with what they need, ``pytest.mark.full("the virtual cluster")``) are left out of
# `make test` (pyproject's ``-m 'not full'``) and run by `make test-all`; each is counted here when left out.
_LEFT_OUT: dict[str, int] = {}


def pytest_deselected(items):  # noqa: ANN001
    """Count the ``full`` tests a marker expression left out, by what they need."""
    for item in items:
        mark = item.get_closest_marker("full")
        if mark is not None:
            need = mark.args[0] if mark.args else "minutes of their own"
            _LEFT_OUT[need] = _LEFT_OUT.get(need, 0) + 1


# What each tier may take on a machine of 2 cores (docs/development.md, "Tests"): the first tier's whole run, and
# the second's as CI runs it (.ci/run, after its installs)
BUDGET_S = {"first": 600, "all": 3600}
_STARTED = time.monotonic()  # this file is imported as the session starts


def pytest_terminal_summary(terminalreporter):  # noqa: ANN001
    """Say what this run left out and which command runs it, and its time against its tier's budget."""
    took = time.monotonic() - _STARTED
    if not _LEFT_OUT:
        if terminalreporter.config.option.markexpr == "":
            terminalreporter.write_line(f"this run, both tiers selected: {took:.0f} s; CI's budget for all of "
                                        f"`make test-all`, installs included: {BUDGET_S['all']} s")
        return
    total = sum(_LEFT_OUT.values())
    terminalreporter.section("not run here", sep="-")
    terminalreporter.write_line(f"{total} tests of the second tier were not run; `make test-all` runs them "
                                "(with everything above):")
    for need, count in sorted(_LEFT_OUT.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"  {count:4d}  need {need}")
    terminalreporter.write_line(f"this run: {took:.0f} s; the first tier's budget on 2 cores: {BUDGET_S['first']} s")


def pytest_collection_finish(session):  # noqa: ANN001
    """A module whose selected tests need a slow preparation (``start_in_background``) starts it now, to run beside
    the tests before them (tests/_background.py)."""
    if session.config.option.collectonly:
        return
    selected: dict = {}
    for item in session.items:
        selected.setdefault(getattr(item, "module", None), []).append(item)
    for module, items in selected.items():
        if hasattr(module, "start_in_background"):
            module.start_in_background(items)


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001, ARG001
    """This process's Open MPI singleton segment, if it made one, is not left in /dev/shm; a background OpenPBS
    preparation that no test waited for (a run stopped early) does not outlive the session."""
    import _background

    from torchhpc.runtime.mpi_info import release_singleton_segment

    release_singleton_segment()
    _background.stop_all()


@pytest.fixture
def solo():
    """A one-rank accl default group (a HashStore rendezvous, no launcher), destroyed after the test."""
    import torch.distributed as dist

    import torchhpc.accl  # noqa: F401  (registers "accl")

    dist.init_process_group("accl", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
