"""Single-process tests of torchhpc.accl: options and the spin's choice, the dtype/op rules, rendezvous fall-back,
a one-rank group and its argument errors, engine errors, CUDA staging (with a GPU), and a stopped peer ending the
job (the benchmark: tests/test_accl_bench.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _mpijob import FAULT_INJECTION

import torchhpc.accl as accl
from torchhpc.accl import rendezvous
from torchhpc.launcher import MPI_LAUNCHER_VARS
from torchhpc.runtime.errors import MismatchError

R = dist.ReduceOp
ROOT = Path(__file__).resolve().parents[1]


def test_options_defaults_and_validation(monkeypatch) -> None:
    for var in ("TORCHHPC_ACCL_ENGINE", "TORCHHPC_ACCL_MAX_SEGMENT_BYTES", "TORCHHPC_ACCL_SIDESTEP",
                "TORCHHPC_ACCL_FLIGHT_STACKS", "TORCHHPC_ACCL_RING_MIN_BYTES"):
        monkeypatch.delenv(var, raising=False)
    o = accl.AcclOptions()
    assert (o.engine, o.max_segment_bytes, o.flight_stacks) == ("mpi", None, False)  # None: accl's choice
    assert o.sidestep == set(accl.core.load_backend().COLLECTIVES) and "all_to_all" in o.sidestep
    monkeypatch.setenv("TORCHHPC_ACCL_MAX_SEGMENT_BYTES", "1024")
    monkeypatch.setenv("TORCHHPC_ACCL_SIDESTEP", "all_reduce, barrier")
    monkeypatch.setenv("TORCHHPC_ACCL_FLIGHT_STACKS", "on")
    o = accl.AcclOptions()
    assert o.max_segment_bytes == 1024 and o.sidestep == {"all_reduce", "barrier"} and o.flight_stacks
    with pytest.raises(ValueError, match="max_segment_bytes"):
        accl.AcclOptions(max_segment_bytes=4)
    assert o.ring_min_bytes is None
    with pytest.raises(ValueError, match="ring_min_bytes"):
        accl.AcclOptions(ring_min_bytes=-1)
    with pytest.raises(ValueError, match="unknown collectives"):
        accl.AcclOptions(sidestep=frozenset({"allreduse"}))
    with pytest.raises(ValueError, match=r"unknown collectives \['alltoallv'\]; known: all_reduce, .*all_to_all"):
        accl.AcclOptions(sidestep=frozenset({"alltoallv"}))  # one name per collective: torch's all_to_all
    monkeypatch.setenv("TORCHHPC_ACCL_RING_MIN_BYTES", "4096")
    assert accl.AcclOptions().ring_min_bytes == 4096
    monkeypatch.setenv("TORCHHPC_ACCL_FLIGHT_STACKS", "maybe")
    with pytest.raises(ValueError, match="TORCHHPC_ACCL_FLIGHT_STACKS"):
        accl.AcclOptions()


def test_the_waits_spin_is_chosen_by_ranks_per_core_and_overridable(monkeypatch) -> None:
    from torchhpc.accl.options import default_spin_us

    monkeypatch.delenv("TORCHHPC_ACCL_SPIN_US", raising=False)
    assert accl.AcclOptions().spin_us is None  # accl's choice, made when the group is built
    for var in [v for v in os.environ if v.startswith(("OMPI_", "PMI_", "PALS_", "MV2_", "SLURM_", "LOCAL_"))]:
        monkeypatch.delenv(var)
    for var in MPI_LAUNCHER_VARS + ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for local, spin in ((1, 1000), (2, 1000), (3, 100)):  # a core for every rank on the node, or not
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", str(local))
        assert default_spin_us() == spin == default_spin_us(ranks_on_node=local), local
    monkeypatch.setenv("TORCHHPC_ACCL_SPIN_US", "250")
    assert accl.AcclOptions().spin_us == 250
    with pytest.raises(ValueError, match="spin_us"):
        accl.AcclOptions(spin_us=-5)


@pytest.mark.parametrize(("dtype", "op", "message"), [
    (torch.float32, R.BAND, "only defined for integer"),
    (torch.bfloat16, R.BXOR, "only defined for integer"),
    (torch.int64, R.AVG, "needs a floating-point"),
    (torch.bool, R.AVG, "needs a floating-point"),
    (torch.complex64, R.SUM, "cannot reduce dtype"),
    (torch.uint16, R.MAX, "cannot reduce dtype"),
])
def test_invalid_reductions_are_named(solo, dtype, op, message) -> None:
    """gloo's (dtype, op) rules, checked by the C++ backend itself (the group's own ``allreduce``: torch's
    ``dist.all_reduce`` would first view a complex tensor as real)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    with pytest.raises(TypeError, match=message):
        solo.allreduce([torch.zeros(4, dtype=dtype)], opts).wait()


def test_premul_sum_is_rejected_clearly(solo) -> None:
    with pytest.raises(ValueError, match="does not support ReduceOp.PREMUL_SUM"):
        dist.all_reduce(torch.zeros(4), op=dist._make_nccl_premul_sum(2.0))


def test_rendezvous_leaves_plain_processes_to_torch(monkeypatch) -> None:
    for var in MPI_LAUNCHER_VARS + ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not rendezvous.under_mpi_launcher()
    with pytest.raises(ValueError, match="RANK expected"):
        dist.init_process_group("gloo")


def test_one_rank_group_runs_every_collective(solo) -> None:
    assert isinstance(solo, accl.ProcessGroupACCL) and solo.name() == "accl"
    t = torch.arange(6.0).view(2, 3).t()
    dist.all_reduce(t, op=R.AVG)
    assert torch.equal(t, torch.arange(6.0).view(2, 3).t())
    out = torch.empty(4)
    dist.all_gather_into_tensor(out, torch.ones(4))
    dist.reduce_scatter_tensor(out, torch.full((4,), 2.0))
    assert torch.all(out == 2)
    dist.broadcast(out, 0)
    o = torch.empty(3)
    dist.all_to_all_single(o, torch.tensor([1.0, 2.0, 3.0]))
    assert o.tolist() == [1.0, 2.0, 3.0]
    dist.barrier()
    objs = [None]
    dist.all_gather_object(objs, {"x": 1})
    assert objs == [{"x": 1}]
    w = dist.all_reduce(torch.ones(2), async_op=True)
    assert w.wait() and w.is_completed() and w.is_success() and w.exception() is None
    assert "AcclWork" in repr(w)
    with pytest.raises(ValueError, match="source_rank"):
        w.source_rank()


def test_the_groups_counters_are_a_mapping(solo) -> None:
    stats = solo.stats
    assert sorted(stats) == ["engine_calls", "max_call_bytes", "queued_calls", "sidestep_calls"]
    stats["max_call_bytes"] = 0
    dist.all_reduce(torch.ones(1 << 12))  # 16 KiB: carried whole by the header exchange, no engine call
    dist.broadcast(torch.ones(1 << 16), 0)  # 256 KiB: one engine call of all of it
    assert stats["max_call_bytes"] == 1 << 18 and dict(stats)["max_call_bytes"] == 1 << 18
    with pytest.raises(KeyError):
        stats["calls"]
    with pytest.raises(TypeError, match="set it to 0"):
        del stats["engine_calls"]


def test_one_rank_group_argument_errors(solo) -> None:
    with pytest.raises(ValueError, match="tag -1 out of range"):
        solo.send([torch.ones(1)], 0, -1)
    with pytest.raises(ValueError, match="dst=3 is not a rank"):
        solo.send([torch.ones(1)], 3, 0)
    with pytest.raises(TypeError, match="AVG needs a floating-point"):
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=R.AVG)
    with pytest.raises(MismatchError, match="sends 12 bytes to rank 0, which expects 8"):
        dist.all_to_all_single(torch.empty(2), torch.empty(3), [], [])
    with pytest.raises(ValueError, match="split_sizes has 2 entries"):
        dist.all_to_all_single(torch.empty(2), torch.empty(2), [1, 1], [2])
    with pytest.raises(ValueError, match="sparse all_reduce supports ReduceOp.SUM only"):
        dist.all_reduce(torch.ones(2).to_sparse(), op=R.MAX)


def test_pg_options_must_be_accl_options() -> None:
    with pytest.raises(TypeError, match="AcclOptions"):
        dist.init_process_group("accl", store=dist.HashStore(), rank=0, world_size=1, pg_options=object())
    if dist.is_initialized():
        dist.destroy_process_group()


def test_accl_engine_without_pyaccl_says_what_is_missing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pyaccl", None)
    with pytest.raises(accl.EngineUnavailableError, match="pyaccl"):
        dist.init_process_group("accl", store=dist.HashStore(), rank=0, world_size=1,
                                pg_options=accl.AcclOptions(engine="accl"))
    if dist.is_initialized():
        dist.destroy_process_group()


def test_cuda_awareness_probe(monkeypatch) -> None:
    accl.mpi_cuda_aware.cache_clear()
    monkeypatch.setenv("TORCHHPC_CUDA_AWARE_MPI", "1")
    assert accl.mpi_cuda_aware() is True
    accl.mpi_cuda_aware.cache_clear()
    monkeypatch.delenv("TORCHHPC_CUDA_AWARE_MPI")
    assert isinstance(accl.mpi_cuda_aware(), bool)
    accl.mpi_cuda_aware.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_are_staged_or_passed(solo) -> None:  # pragma: no cover - needs a GPU
    t = torch.ones(1000, device="cuda")
    dist.all_reduce(t)
    assert t.device.type == "cuda" and torch.all(t == 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_calls_follow_the_callers_stream(solo) -> None:  # pragma: no cover - needs a GPU
    """Staging runs on the caller's stream of issue: the kernels queued before a call (on a side stream, behind a
    long one) are in what it sends, and an async call finished on the worker thread delivers before wait()."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.ones(1 << 22, device="cuda")
        torch.cuda._sleep(50_000_000)  # keeps the side stream busy for a while
        t.mul_(3)
        dist.all_reduce(t)
        assert torch.all(t == 3)
        u = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        torch.cuda._sleep(50_000_000)
        u.add_(1)
        out = torch.empty_like(u)
        w = dist.all_gather_into_tensor(out, u, async_op=True)
        w.wait()
        assert torch.equal(out, u)


@FAULT_INJECTION
def test_a_stopped_peer_ends_the_job_instead_of_holding_it_at_exit() -> None:
    """Rank 2 of 3 SIGSTOPs itself mid-loop (a node that stops answering without dying): the others raise
    torchhpc's timeout naming the rank they wait on, and at exit, where MPI_Finalize would wait for the stopped
    rank for ever, they give it the group timeout at a barrier, then end the job with MPI_Abort."""
    import time

    from _mpijob import run_mpi

    start = time.monotonic()
    res = run_mpi(3, [sys.executable, str(Path(__file__).parent / "vcluster" / "node_failure.py"), "2", "2"],
                  timeout=120)
    out = res.stdout + (res.stderr or "")
    assert time.monotonic() - start < 60, out[-5000:]
    assert res.returncode != 0 and "ending the job with MPI_Abort" in out, out[-5000:]
    survivors = re.findall(r"SURVIVOR rank=([01]) host=\S+ after=([\d.]+)s cpu=[\d.]+s family=torchhpc "
                           r"error=PeerTimeoutError: .* rank (\d) \(this rank was waiting on it\)", out)
    assert sorted(r for r, *_ in survivors) == ["0", "1"], out[-5000:]
    assert all(float(after) < 2 + 5 for _, after, _ in survivors), survivors
    # the rank that waits on the stopped one names it (the other waits on that rank, which is stuck itself)
    assert "2" in [peer for *_, peer in survivors], survivors


@FAULT_INJECTION
def test_a_peer_stopped_after_the_last_collective_ends_the_job_at_exit() -> None:
    """Rank 2 of 3 SIGSTOPs itself right after its last collective: the others finish without an error, and
    at exit wait for it at most the default group's timeout (2 s) instead of in MPI_Finalize for ever."""
    import time

    from _mpijob import run_mpi

    start = time.monotonic()
    res = run_mpi(3, [sys.executable, str(Path(__file__).parent / "vcluster" / "node_failure.py"), "2", "2",
                      "--steps", "20"], timeout=120)
    out = res.stdout + (res.stderr or "")
    assert time.monotonic() - start < 60, out[-5000:]
    assert sorted(re.findall(r"DONE rank=([01]) ", out)) == ["0", "1"] and "SURVIVOR" not in out, out[-5000:]
    assert res.returncode != 0 and "waited 2 s at exit for peers that did not come" in out, out[-5000:]


@FAULT_INJECTION
def test_a_peer_stopped_inside_a_blocking_collective_ends_the_job() -> None:
    """Rank 2 of 3 stops inside MPI's blocking data phase of a large all_reduce (after the header proved that
    every rank arrived): MPI cannot interrupt the others' call, so accl's watchdog ends the job a second past
    the group timeout, naming the call, instead of leaving it to hang."""
    import time

    from _mpijob import run_mpi

    start = time.monotonic()
    res = run_mpi(3, [sys.executable, str(Path(__file__).parent / "accl_stopped_in_data.py")], timeout=120)
    out = res.stdout + (res.stderr or "")
    assert time.monotonic() - start < 60, out[-5000:]
    assert res.returncode != 0 and "COMPLETED" not in out, out[-5000:]
    assert re.search(r"all_reduce\(float32, 134217728 elements, SUM\) as call #\d+ in group '\S+' \(rank [01] of 3\) "
                     r"is still inside MPI's blocking collective", out), out[-5000:]


def test_the_plan_gives_each_call_the_documented_path() -> None:
    """docs/accl.md's plan table, at its boundaries: carried up to 16 KiB on a node and 64 KiB less the prefix
    across nodes (reduce_scatter across nodes up to 3,840 bytes), the ring for larger reduce_scatters and for larger
    all_reduces across nodes, MPI otherwise and on another engine."""
    from torchhpc.accl.options import AcclOptions, plan

    node, net = 16 << 10, (64 << 10) - 256
    assert [plan("all_reduce", b, 2, False) for b in (8, node, node + 4)] == ["carried", "carried", "mpi"]
    assert [plan("all_reduce", b, 4, True) for b in (net, net + 4)] == ["carried", "ring"]
    assert [plan("_reduce_scatter_base", b, 2, True) for b in (3840, 3844)] == ["carried", "ring"]
    assert plan("_reduce_scatter_base", node + 8, 2, False) == "ring"
    assert plan("broadcast", 1 << 20, 4, True) == plan("reduce", 8, 2, False) == "mpi"
    assert plan("all_to_all_single", 8, 2, False) == "mpi" and plan("barrier", 0, 2, False) == "carried"
    assert plan("all_reduce", 1 << 20, 2, False, AcclOptions(ring_min_bytes=1 << 20)) == "ring"
    assert plan("all_gather", 64, 2, False, AcclOptions(max_segment_bytes=32)) == "mpi"
    with pytest.raises(ValueError, match="no collective named 'allreduce'"):
        plan("allreduce", 8, 2, False)
    out = subprocess.run([sys.executable, "-m", "torchhpc", "bench", "--plan", "--np", "2", "--max-bytes", "32768"],
                         capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.strip().startswith("32 KiB"))
    cells = [c.split() for c in row.split("|")[1:]]  # allreduce ... reduce_scatter: one node / across nodes
    assert cells[0] == ["mpi", "/", "carried"] and cells[3] == ["ring", "/", "ring"], row
