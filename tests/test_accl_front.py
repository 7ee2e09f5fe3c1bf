"""accl's C++ front: built warning-free for the running torch, refused for another, installed on MPI-engine
groups, taking exactly the common synchronous case and handing every other case (and every error) to the
Python adapter; and on a real two-rank launch, the front and the adapter give the same results."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _mpijob import run_mpi

from torchhpc.accl import core, corebuild
from torchhpc.accl.process_group import ProcessGroupACCL

pytestmark = pytest.mark.skipif(core.load_front() is None, reason=core.front_status()[1])


def test_front_builds_warning_free_for_this_torch(tmp_path: Path) -> None:
    """The front compiles with -Wall -Wextra -Werror against the installed torch's headers, records that torch,
    and an up-to-date build is kept."""
    out = corebuild.build_front(dest=tmp_path, force=True)
    assert out.parent == tmp_path and out.name.startswith("_front.") and out.stat().st_size > 0
    assert (tmp_path / "_front.torch").read_text().strip() == torch.__version__
    again = corebuild.build_front(dest=tmp_path)
    assert again == out and again.stat().st_mtime == out.stat().st_mtime


def test_front_for_another_torch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    core.front_status.cache_clear()
    monkeypatch.setattr(core.torch, "__version__", "0.0.1")
    try:
        with pytest.warns(RuntimeWarning, match="built for torch .* running 0.0.1"):
            mod, why = core.front_status()
        assert mod is None and "--front only --force" in why
    finally:
        monkeypatch.undo()
        core.front_status.cache_clear()
    assert core.load_front() is not None


class _Count:
    """Wraps ProcessGroupACCL.<name> (what the front falls back to) and counts the calls that reached it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.n = 0
        orig = getattr(ProcessGroupACCL, name)

        def wrapped(pg, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.n += 1
            return orig(pg, *args, **kw)

        monkeypatch.setattr(ProcessGroupACCL, name, wrapped)


def test_front_is_installed_and_takes_the_common_case(solo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hottest calls are the front's; a synchronous call of contiguous CPU tensors never reaches the
    adapter once the group has seen its reduction, and still moves data through the core."""
    assert solo._front is not None and repr(solo.allreduce) == "<accl front all_reduce>"
    counts = {n: _Count(monkeypatch, n) for n in ("allreduce", "broadcast", "all_gather_single",
                                                  "reduce_scatter_single", "all_to_all_single")}
    t = torch.arange(6, dtype=torch.float32)
    dist.all_reduce(t)  # first float32 SUM: the adapter builds the reduction and teaches the front
    assert counts["allreduce"].n == 1
    calls = solo.stats["engine_calls"]
    for _ in range(3):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    dist.broadcast(t, 0)
    out = torch.empty(6)
    dist.all_gather_into_tensor(out, t)
    dist.reduce_scatter_tensor(out, t)
    dist.all_to_all_single(out, t)
    assert torch.equal(out, torch.arange(6, dtype=torch.float32))
    assert {n: c.n for n, c in counts.items()} == {"allreduce": 1, "broadcast": 0, "all_gather_single": 0,
                                                   "reduce_scatter_single": 0, "all_to_all_single": 0}
    dist.all_reduce(torch.ones(4096))  # past the header slot: a real MPI call, counted by the core
    assert solo.stats["engine_calls"] == calls + 1 and counts["allreduce"].n == 1


def test_front_hands_every_other_case_to_the_adapter(solo, monkeypatch: pytest.MonkeyPatch) -> None:
    """Async calls, strided tensors, tensor subclasses, AVG, explicit splits, and bad arguments all reach the
    adapter, which gives its results and its own error messages."""
    dist.all_reduce(torch.ones(2))  # (float32 SUM learnt)
    ar, bc = _Count(monkeypatch, "allreduce"), _Count(monkeypatch, "broadcast")
    ag, a2a = _Count(monkeypatch, "all_gather_single"), _Count(monkeypatch, "all_to_all_single")
    dist.all_reduce(torch.ones(4), async_op=True).wait()
    dist.all_reduce(torch.ones(4, 2)[:, 0])  # strided
    dist.all_reduce(torch.nn.Parameter(torch.ones(3), requires_grad=False))  # a subclass
    t = torch.full((4,), 3.0)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.equal(t, torch.full((4,), 3.0))
    dist.all_reduce(torch.ones(2, dtype=torch.int16))  # a reduction not seen yet
    assert ar.n == 5
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.asyncOp = 3, False
    with pytest.raises(ValueError, match="root"):
        solo.broadcast([torch.ones(2)], opts)
    assert bc.n == 1  # the bad root, with the adapter's message
    with pytest.raises(ValueError, match="all_gather_into_tensor output has 3 elements"):
        dist.all_gather_into_tensor(torch.empty(3), torch.ones(2))
    assert ag.n == 1
    out = torch.empty(4)
    dist.all_to_all_single(out, torch.arange(4.0), [4], [4])  # explicit splits
    assert torch.equal(out, torch.arange(4.0)) and a2a.n == 1
    a2a_opts = dist.AllToAllOptions()
    a2a_opts.asyncOp = False
    with pytest.raises(TypeError, match="dtypes differ"):  # (torch's wrapper checks this too: call the group)
        solo.all_to_all_single(torch.empty(4, dtype=torch.float64), torch.ones(4), [], [], a2a_opts)
    assert a2a.n == 2


def test_doctor_names_the_front() -> None:
    from torchhpc import accl

    assert dict(accl.environment_report())["accl C++ front"] == f"built for torch {torch.__version__}"


def test_front_off_by_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCHHPC_ACCL_FRONT=0: every call goes through the adapter."""
    import torchhpc.accl  # noqa: F401  (registers "accl")

    monkeypatch.setenv("TORCHHPC_ACCL_FRONT", "0")
    dist.init_process_group("accl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        assert pg._front is None and "allreduce" not in vars(pg)
        t = torch.ones(3)
        dist.all_reduce(t)
        assert torch.equal(t, torch.ones(3))
    finally:
        dist.destroy_process_group()


SAME_SCRIPT = r'''
import os, torch, torch.distributed as dist
import torchhpc.accl  # registers "accl"
dist.init_process_group("accl")
r, p = dist.get_rank(), dist.get_world_size()
pg = dist.group.WORLD
front = os.environ.get("TORCHHPC_ACCL_FRONT", "1") != "0"
assert (pg._front is not None) == front
g = torch.Generator().manual_seed(7 + r)
for dtype in (torch.float32, torch.float64, torch.int32, torch.bfloat16):
    for n in (1, 5, 4096, 300000):
        x = (torch.rand(n, generator=g) * 100).to(dtype)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            y = x.clone(); dist.all_reduce(y, op=op)
            w = [torch.empty_like(x) for _ in range(p)]; dist.all_gather(w, x)
            ref = {dist.ReduceOp.SUM: lambda s: s.sum(0), dist.ReduceOp.MAX: lambda s: s.max(0).values,
                   dist.ReduceOp.MIN: lambda s: s.min(0).values}[op](torch.stack(w).double())
            assert torch.allclose(y.double(), ref.to(dtype).double(), rtol=1e-2), (dtype, n, op)
        b = x.clone(); dist.broadcast(b, p - 1)
        ag = torch.empty(p * n, dtype=dtype); dist.all_gather_into_tensor(ag, x)
        assert torch.equal(ag[r * n:(r + 1) * n], x)
        dist.broadcast(ag, 0)
        rs = torch.empty(n, dtype=dtype); dist.reduce_scatter_tensor(rs, ag)
        a2 = torch.empty(p * n, dtype=dtype); dist.all_to_all_single(a2, ag)
        print(f"rank {r} {dtype} {n} {float(b.double().sum())} {float(rs.double().sum())} "
              f"{float(a2.double().sum())}", flush=True)
dist.destroy_process_group()
print(f"rank {r}: done", flush=True)
'''


@pytest.mark.parametrize("variant", ["plain", "mpich"])
def test_front_and_adapter_agree_on_a_real_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  variant: str) -> None:
    """Under plain mpiexec -n 2 of the Open MPI wheel and of the MPICH wheel: every collective the front
    takes, over dtypes, sizes from one element to past the segment, and ops, checked against its reference,
    with the front and with the adapter alone; the two runs print the same results."""
    script = tmp_path / "same.py"
    script.write_text(SAME_SCRIPT)
    outs = {}
    for front in ("1", "0"):
        monkeypatch.setenv("TORCHHPC_ACCL_FRONT", front)
        res = run_mpi(2, [sys.executable, str(script)], timeout=300, variant=variant)
        assert res.returncode == 0, res.stdout[-4000:]
        assert res.stdout.count(": done") == 2, res.stdout[-4000:]
        # (records found wherever they are: two ranks' lines may run together in the launcher's output)
        outs[front] = sorted(re.findall(r"rank \d torch\.\w+ \d+ \S+ \S+ [-+.\de]+", res.stdout))
        assert len(outs[front]) == 2 * 4 * 4, res.stdout[-4000:]  # ranks x dtypes x sizes
    assert outs["1"] == outs["0"]


def test_bench_compares_front_and_adapter_and_splits_the_gap() -> None:
    """``torchhpc bench --impls accl,accl-py,mpi4py`` times the adapter alone beside the front, and
    bench/accl_gap.py prints each layer's step, under plain mpiexec -n 2."""
    root = Path(__file__).resolve().parent.parent
    res = run_mpi(2, [sys.executable, "-m", "torchhpc", "bench", "alltoall", "--quick", "--max-bytes", "4096",
                      "--time-per-point", "0.02", "--impls", "accl,accl-py,mpi4py"], timeout=150)
    assert res.returncode == 0, res.stdout[-4000:]
    rows = [ln for ln in res.stdout.splitlines() if ln.strip().startswith(("8 B", "4 KiB"))]
    assert re.search(r"\|\s+accl-py\s+\|", res.stdout) and len(rows) == 2 and all(ln.count("|") == 4 for ln in rows)
    res = run_mpi(2, [sys.executable, str(root / "bench" / "accl_gap.py"), "--collective", "all_gather",
                      "--bytes", "65536", "--repeats", "1", "--iters", "20"], timeout=150)
    assert res.returncode == 0, res.stdout[-4000:]
    steps = [m.group(1) for m in re.finditer(r"^\s+(\S+)\s+[\d.]+ \[", res.stdout, re.M)]
    assert steps == ["raw", "raw+header", "core", "group", "torch"], res.stdout[-2000:]
