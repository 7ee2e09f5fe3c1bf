"""One rank of PyTorch's own distributed test suite, run in an mpiexec world (see ``driver.py``).

PyTorch's spawn harness (test/distributed/test_distributed_spawn.py) makes, per test, a fresh
TEMP_DIR with ``barrier``/``test_dir``/``init_dir`` and a fresh init file, then runs
``TestDistBackend._run(rank, test_name, file_name, pipe)`` in each of WORLD_SIZE spawned processes.
An MPI backend cannot be spawned (its ranks are the MPI job's processes), so here every MPI rank runs
that same ``_run`` for one test after another, with the same per-test set-up, made by rank 0 and shared
with ``MPI_Bcast``.  Only the harness is adapted; the tests and their assertions are torch's own.

The one declaration made for a third-party backend: ``DistTestCases.backend_feature`` lists, per feature,
the backends that implement it (``"plugin"`` is torch's slot for out-of-tree backends); with
``--declare-features`` the accl backend is entered for ``plugin``, ``ddp`` and ``subgroup`` (what it
implements on CPU).  ``--backend mpi_upstream`` (PyTorch's own ProcessGroupMPI, ``make mpi-backend``) runs
as ``BACKEND=mpi`` in torch's own MPI slot, as PyTorch's CI runs the suite for its MPI backend.
Results go to a JSON-lines file, one line per test, written by rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ACCL_FEATURES = ("plugin", "ddp", "subgroup")
TORCH_NAMES = {"mpi_upstream": "mpi"}  # backend -> the BACKEND torch's suite runs it as


class _SkipReasons(logging.Handler):
    """Collects the reasons torch's harness logs for tests that raise ``unittest.SkipTest``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "skipping test" in msg:
            self.reasons.append(msg.split("following reason: ", 1)[-1])


def _fresh_temp_dir(comm) -> str:
    """What ``initialize_temp_directories`` makes in torch's harness, made once and shared by every rank."""
    path = None
    if comm.Get_rank() == 0:
        path = tempfile.mkdtemp(prefix="torchsuite-")
        for sub in ("barrier", "test_dir", "init_dir"):
            os.mkdir(os.path.join(path, sub))
    return comm.bcast(path, root=0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--tests", required=True, help="file with one test name per line")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--results", required=True)
    parser.add_argument("--progress", required=True)
    parser.add_argument("--declare-features", action="store_true")
    parser.add_argument("--ignore-skip-markers", action="store_true",
                        help="run tests even where a unittest skip marker (e.g. gloo-only) says not to")
    args = parser.parse_args()

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    # mpi_upstream is PyTorch's own MPI backend (make mpi-backend): it runs as torch's "mpi", as PyTorch's CI runs
    # this suite for BACKEND=mpi (rank and world size from MPI, no rendezvous), with nothing declared for it
    torch_name = TORCH_NAMES.get(args.backend, args.backend)
    os.environ["BACKEND"] = torch_name
    os.environ["WORLD_SIZE"] = str(size)
    os.environ["TEMP_DIR"] = _fresh_temp_dir(comm)  # read when distributed_test is imported
    if args.backend == "accl":
        import torchhpc.accl  # noqa: F401  (registers the backend)
    elif args.backend == "mpi_upstream":
        import torchhpc.mpi_upstream

        torchhpc.mpi_upstream.use_as_torch_mpi()

    from torch.testing._internal import common_distributed as cd

    if args.declare_features and torch_name not in ("gloo", "nccl", "ucc", "mpi"):
        for feature in ACCL_FEATURES:
            cd.DistTestCases.backend_feature[feature].add(args.backend)
    import torch.distributed as dist
    from torch.multiprocessing import Pipe
    from torch.testing._internal.distributed import distributed_test as dt

    comm.Barrier()
    if rank == 0:  # each test gets its own TEMP_DIR below; this one only had to exist for the import
        shutil.rmtree(os.environ["TEMP_DIR"], ignore_errors=True)

    class TestDistBackendMPI(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        """torch's test class, run by the ranks of an MPI job instead of spawned processes."""

    skips = _SkipReasons()
    cd.logger.addHandler(skips)
    cd.logger.setLevel(logging.INFO)
    codes = {s.exit_code: (key, s.message) for key, s in cd.TEST_SKIPS.items()}

    names = Path(args.tests).read_text().split()
    for index in range(args.start, len(names)):
        name = names[index]
        temp_dir = _fresh_temp_dir(comm)
        os.environ["TEMP_DIR"] = temp_dir
        os.environ["INIT_METHOD"] = dt.FILE_SCHEMA + os.path.join(temp_dir, "init_dir", "shared_init_file")
        dt.INIT_METHOD = os.environ["INIT_METHOD"]
        dt.Barrier.barrier_id = 0
        if rank == 0:
            Path(args.progress).write_text(json.dumps({"index": index, "test": name, "start": time.time()}))
        comm.Barrier()
        skips.reasons.clear()
        ours, theirs = Pipe()
        t0 = time.perf_counter()
        code, detail = 0, ""
        method = getattr(TestDistBackendMPI, name)
        try:
            # unittest skips a test marked __unittest_skip__ (unittest.skipIf, torch's
            # skip_but_pass_in_sandcastle_if) before running it; _run alone would not
            marked = any(getattr(x, "__unittest_skip__", False) for x in (TestDistBackendMPI, method))
            if marked and not args.ignore_skip_markers:
                skips.reasons.append(getattr(method, "__unittest_skip_why__", "") or "skipped by unittest marker")
                code = cd.TEST_SKIPS["generic"].exit_code
            else:
                TestDistBackendMPI._run(rank, name, os.path.join(temp_dir, "init_file"), theirs)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - an error outside run_test (e.g. in init_process_group)
            code, detail = 10, traceback.format_exc()
        try:
            if ours.poll():
                detail = ours.recv()  # the traceback torch's run_test sends its parent
        except (EOFError, OSError):
            pass
        if code in codes:
            detail = skips.reasons[-1] if skips.reasons else codes[code][1]
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a failed test may leave its group half torn down
                dist.destroy_process_group()
        outcome = "pass" if code == 0 else "skip" if code in codes else "fail"
        everyone = comm.allgather((outcome, detail[-4000:]))
        if rank == 0:
            outcomes = [o for o, _ in everyone]
            final = "fail" if "fail" in outcomes else "skip" if "skip" in outcomes else "pass"
            details = {r: d for r, (o, d) in enumerate(everyone) if o == final and d}
            first = next(iter(details.values()), "")
            with open(args.results, "a") as f:
                f.write(json.dumps({"index": index, "test": name, "outcome": final,
                                    "seconds": round(time.perf_counter() - t0, 2),
                                    "detail": first, "ranks": sorted(details)}) + "\n")
            shutil.rmtree(temp_dir, ignore_errors=True)
        if any(o == "fail" for o, _ in everyone):
            # a failed test may leave groups or messages behind: start the next test in a fresh job
            sys.stdout.flush()
            sys.stderr.flush()
            comm.Barrier()
            return 3
    if rank == 0:
        Path(args.progress).write_text(json.dumps({"index": len(names), "test": None, "start": time.time()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
