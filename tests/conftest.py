"""Shared pytest set-up: tests import torchhpc from src/ even without `make env`'s editable install; the
one-rank accl group fixture."""

import sys
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


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001, ARG001
    """This process's Open MPI singleton segment, if it made one, is not left in /dev/shm."""
    from torchhpc.runtime.mpi_info import release_singleton_segment

    release_singleton_segment()


@pytest.fixture
def solo():
    """A one-rank accl default group (a HashStore rendezvous, no launcher), destroyed after the test."""
    import torch.distributed as dist

    import torchhpc.accl  # noqa: F401  (registers "accl")

    dist.init_process_group("accl", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
