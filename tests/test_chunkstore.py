"""Single-process ChunkTensor tests: layout, shared-memory lifecycle after crashes, limits, CUDA skip."""

import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from torchhpc.chunkstore import ChunkTensor, SharedMemoryTooSmall, reap_dead_segments
from torchhpc.chunkstore.layout import plan_layout, positions_from_order
from torchhpc.chunkstore.shm import Segment, list_segments
from torchhpc.runtime.mpirun import local_job_env, mpiexec_argv

ROOT = Path(__file__).resolve().parents[1]

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _env():
    env = local_job_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return env


def test_layout_fills_devices_evenly_then_host():
    lay = plan_layout(100, 8, 30 * 8, [2, 2])
    assert lay.node_starts == (0, 50, 100)
    assert lay.device_rows == ((25, 25), (25, 25))  # capacity 30 rows but only 50 per node: split evenly
    assert lay.host_rows(0) == 0
    lay = plan_layout(101, 8, 10 * 8 + 7, [3])
    assert lay.device_rows == ((10, 10, 10),) and lay.host_rows(0) == 71
    assert lay.segment_starts(0) == [0, 10, 20, 30]
    assert plan_layout(5, 8, 0, [2, 1]).device_rows == ((0, 0), (0,))
    with pytest.raises(ValueError, match="smaller than one row"):
        plan_layout(5, 8, 4, [1])
    with pytest.raises(ValueError, match=">= 0"):
        plan_layout(5, 8, -1, [1])


def test_hot_order_deals_rows_over_nodes():
    lay = plan_layout(7, 4, 0, [1, 1])
    order = torch.tensor([6, 5, 4, 3, 2, 1, 0])
    pos_of, id_at = positions_from_order(order, lay)
    # hottest (6) first on node 0, second hottest (5) first on node 1 (which starts at position 4)
    assert pos_of[6] == 0 and pos_of[5] == 4 and pos_of[4] == 1
    assert torch.equal(id_at[pos_of], torch.arange(7))


def test_single_process_gather_and_views():
    t = torch.randn(50, 3)
    with ChunkTensor(t.shape, t.dtype, 12 * 20) as ct:
        ct.load_from_tensor(t)
        assert torch.equal(ct.device_view(), t[:20]) and torch.equal(ct.host_view(), t[20:])
        idx = torch.tensor([19, 20, 0, 49, 19, 20])
        assert torch.equal(ct[idx], t[idx])


def test_too_small_shared_memory_says_how_to_raise_it():
    with pytest.raises(SharedMemoryTooSmall, match=r"--shm-size|remount"):
        ChunkTensor((2**40, 64), torch.float32, 0)  # 256 TiB host tier
    assert not [p for p, pid in list_segments() if pid == os.getpid()]


def test_cuda_requested_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="cuda"):
        ChunkTensor((4, 4), torch.float32, 0, use_cuda=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_device_tier_gathers():
    t = torch.randn(300, 8)
    with ChunkTensor(t.shape, t.dtype, 100 * 32, use_cuda=True) as ct:
        ct.load_from_tensor(t)
        assert ct.device_view().is_cuda
        idx = torch.randint(0, 300, (1000,))
        assert torch.equal(ct[idx].cpu(), t[idx])


def _wait_line(proc, want, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if want in line:
            return line
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"child never printed {want!r}")


def test_segment_of_a_killed_process_is_reaped():
    """A process killed while its segment still has a name (job set-up) leaves it; the next job reaps it."""
    code = textwrap.dedent("""
        import sys, time
        from torchhpc.chunkstore.shm import Segment
        s = Segment.create(1 << 20)
        print("READY", s.path, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_env())
    path = Path(_wait_line(proc, "READY").split()[1])
    assert path.exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert path.exists()  # the dead owner could not clean up
    live = Segment.create(4096)  # creating a segment (as the next job does) reaps the dead one
    try:
        assert not path.exists()
        assert reap_dead_segments() == [] and live.path.exists()  # live owners are left alone
    finally:
        live.close()
    assert not live.path.exists()


def test_killed_mpi_job_leaves_no_segments():
    """SIGKILL the ranks of a 2-rank job holding ChunkTensors: nothing of it remains in /dev/shm."""
    code = textwrap.dedent("""
        import os, time, torch
        from mpi4py import MPI
        from torchhpc.chunkstore import ChunkTensor
        ct = ChunkTensor((1000, 16), torch.float32, 100 * 64)
        ct.load_from_tensor(torch.randn(1000, 16))
        print("READY", os.getpid(), flush=True)
        time.sleep(60)
    """)
    cmd = mpiexec_argv(2, [sys.executable, "-c", code])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            start_new_session=True)
    pids: set[int] = set()
    try:
        pids = {int(_wait_line(proc, "READY").split()[1]), int(_wait_line(proc, "READY").split()[1])}
        # while running, the ranks map their segments but none has a name left
        for pid in pids:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "torchhpc-cs." in maps and "(deleted)" in maps
        assert not [p for p, owner in list_segments() if owner in pids]
    finally:
        # a crash: the ranks die by SIGKILL (mpiexec runs each rank in its own process group)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert not [p for p, owner in list_segments() if owner in pids]


def test_hot_order_helpers():
    from torchhpc.chunkstore import hot_order_by_degree, hot_order_from_scores

    assert torch.equal(hot_order_by_degree(torch.tensor([0, 1, 4, 4, 6])), torch.tensor([1, 3, 0, 2]))
    assert torch.equal(hot_order_from_scores(torch.tensor([0.5, 2.0, 0.5])), torch.tensor([1, 0, 2]))
    with pytest.raises(ValueError, match="1-D"):
        hot_order_from_scores(torch.zeros(2, 2))


def test_empty_shapes():
    with ChunkTensor((0, 4), torch.float32, 0) as ct:
        ct.load_from_tensor(torch.empty(0, 4))
        assert ct.index(torch.empty(0, dtype=torch.int64)).shape == (0, 4)
        with pytest.raises(IndexError, match="out of range"):
            ct[torch.tensor([0])]
    with ChunkTensor((5, 0), torch.int32, 0) as ct:
        ct.load_from_tensor(torch.empty(5, 0, dtype=torch.int32))
        assert ct[torch.tensor([4, 0])].shape == (2, 0)


def test_single_node_gather_inputs_and_errors():
    """The one-node fast path accepts every index form the general path does and fails just as clearly."""
    import numpy as np

    t = torch.randn(30, 4)
    with ChunkTensor(t.shape, t.dtype, 10 * 16) as ct:
        ct.load_from_tensor(t)
        assert ct._fast
        idx = torch.tensor([29, 0, 10, 9, 10])
        for form in (idx, idx.int(), idx.tolist(), idx.numpy(), np.array(idx.tolist(), dtype=np.int32)):
            assert torch.equal(ct.index(form), t[idx])
        assert torch.equal(ct[torch.tensor(7)], t[7]) and ct[torch.tensor(7)].shape == (4,)  # 0-d index
        assert torch.equal(ct[idx.view(5, 1)], t[idx.view(5, 1)])
        strided = torch.zeros(5, 8)[:, ::2]  # a non-contiguous out of the right shape is filled in place
        assert ct.index(idx, out=strided).data_ptr() == strided.data_ptr() and torch.equal(strided, t[idx])
        flat = torch.empty(20)  # contiguous with the right number of elements: viewed, not resized
        assert torch.equal(ct.index(idx, out=flat).view(5, 4), t[idx])
        for bad_out, what in ((torch.empty(4, 4), "shape"), (torch.empty(6, 4), "shape"),
                              (torch.empty(5, 4, dtype=torch.float64), "float32")):
            before = bad_out.shape
            with pytest.raises(ValueError, match=what):
                ct.index(idx, out=bad_out)
            assert bad_out.shape == before  # never resized behind the caller's back
        for bad in (torch.tensor([30]), torch.tensor([3, -1]), torch.tensor([-31])):
            with pytest.raises(IndexError, match="out of range for a ChunkTensor of 30 rows"):
                ct[bad]
            with pytest.raises(IndexError, match="out of range"):
                ct.index(bad, out=torch.empty(len(bad), 4))
        assert ct.index([]).shape == (0, 4)
        for bad in (torch.tensor([1.0]), torch.tensor([True]), torch.tensor([1], dtype=torch.int16), [1.5]):
            with pytest.raises(TypeError, match="int32 or int64"):
                ct[bad]


def test_argument_mistakes_and_use_after_close_are_clear():
    with pytest.raises(TypeError, match="shape must be an int"):
        ChunkTensor((10.5, 4), torch.float32, 0)
    with pytest.raises(TypeError, match="number of bytes"):
        ChunkTensor((10, 4), torch.float32, 100.5)
    with pytest.raises(ValueError, match="timeout"):
        ChunkTensor((10, 4), torch.float32, 0, timeout=0)
    ct = ChunkTensor((10, 4), torch.float32, 1e3)  # an integral float capacity is fine
    assert ct.capacity_per_device == 1000
    ct.close()
    for use in (lambda: ct[torch.tensor([1])], lambda: ct.split_index([1]), lambda: ct.host_index([9]),
                lambda: ct.load_from_tensor(torch.zeros(10, 4))):
        with pytest.raises(RuntimeError, match="closed"):
            use()


def test_options_object_and_keywords_are_one_convention():
    """ChunkStoreOptions holds the settings; keywords that are given override its fields; validate() names the field."""
    from torchhpc.chunkstore import ChunkStoreOptions

    opts = ChunkStoreOptions(capacity_per_device=64, timeout=30.0)
    opts.validate()
    with ChunkTensor((10, 4), torch.float32, options=opts) as ct:
        assert (ct.capacity_per_device, ct.timeout) == (64, 30.0) and ct.options == opts
    with ChunkTensor((10, 4), torch.float32, 32, options=opts, row_transport="group") as ct:  # keywords win
        assert (ct.capacity_per_device, ct.timeout, ct.options.row_transport) == (32, 30.0, "group")
    assert opts.row_transport == "mpi"
    for bad, typ, field in ((ChunkStoreOptions(capacity_per_device="1k"), TypeError, "capacity_per_device"),
                            (ChunkStoreOptions(capacity_per_device=-1), ValueError, "capacity_per_device"),
                            (ChunkStoreOptions(ranks_per_node=0), ValueError, "ranks_per_node"),
                            (ChunkStoreOptions(timeout=-1.0), ValueError, "timeout"),
                            (ChunkStoreOptions(row_transport="tcp"), ValueError, "row_transport")):
        with pytest.raises(typ, match=field):
            bad.validate()
        with pytest.raises(typ, match=field):
            ChunkTensor((10, 4), torch.float32, options=bad)
    with pytest.raises(TypeError, match="capacity_per_device"):
        ChunkTensor((10, 4), torch.float32)  # no capacity given at all
    with pytest.raises(TypeError, match="ChunkStoreOptions"):
        ChunkTensor((10, 4), torch.float32, options={"capacity_per_device": 0})


_PAGES = """
import sys
from pathlib import Path
from torchhpc.chunkstore import ChunkTensor
from torchhpc.chunkstore.shm import Segment, shared_page_setting
import torch
d = Path(sys.argv[1])
seg = Segment.create(8 << 20, d)
ct = ChunkTensor((16384, 128), torch.float32, capacity_per_device=0)
ct.load_from_tensor(torch.arange(16384 * 128, dtype=torch.float32).view(16384, 128))
assert torch.equal(ct[torch.tensor([5, 16383])][:, 0], torch.tensor([640.0, 16383 * 128.0]))
print("PAGES", seg.huge_kib(), ct._segments[0].huge_kib(), ct._segments[0].nbytes >> 10, *shared_page_setting(d))
ct.close(); seg.close()
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to mount a tmpfs")
@pytest.mark.parametrize("huge", ["advise", "within_size", "never"])
def test_host_tier_gets_huge_pages_where_the_tmpfs_gives_them(tmp_path, huge: str) -> None:
    """A private tmpfs mounted huge=advise or within_size (a cluster admin's /dev/shm option) backs a segment and a
    ChunkTensor's host tier with 2 MiB pages (smaps' ShmemPmdMapped); huge=never with 4 KiB pages, as before."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    script = tmp_path / "pages.py"
    script.write_text(_PAGES)
    cmd = (f"mount -t tmpfs -o huge={huge},size=64m tmpfs {mnt} && "
           f"TORCHHPC_SHM_DIR={mnt} {shlex.quote(sys.executable)} {script} {mnt}")
    res = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    seg_kib, tier_kib, tier_size_kib, possible, why = res.stdout.split("PAGES", 1)[1].split(maxsplit=4)
    if huge == "never":
        assert (seg_kib, tier_kib, possible) == ("0", "0", "False"), res.stdout
    else:
        assert seg_kib == str(8 << 10) and possible == "True", res.stdout
        assert int(tier_kib) >= int(tier_size_kib) // 2048 * 2048, res.stdout  # every whole 2 MiB of it
    assert f"huge={huge}" in why


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to mount a tmpfs")
def test_a_segment_the_tmpfs_cannot_fill_is_refused_not_a_later_sigbus(tmp_path) -> None:
    """Filling a segment larger than its tmpfs (another job took the space after the size check) raises
    SharedMemoryTooSmall from the fill (MADV_POPULATE_WRITE's EFAULT), instead of a SIGBUS at some later write."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    code = ("import os, sys\nfrom pathlib import Path\nfrom torchhpc.chunkstore.shm import Segment, "
            "SharedMemoryTooSmall\np = Path(sys.argv[1]) / 'seg'\nfd = os.open(p, os.O_RDWR | os.O_CREAT)\n"
            "os.ftruncate(fd, 32 << 20)\nseg = Segment(p, 32 << 20, fd, owner=True)\ntry:\n    seg._reserve()\n"
            "except SharedMemoryTooSmall as e:\n    print('REFUSED', e)\n")
    cmd = (f"mount -t tmpfs -o size=16m tmpfs {mnt} && {shlex.quote(sys.executable)} -c {shlex.quote(code)} {mnt}")
    res = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, check=False)
    assert res.returncode == 0 and "REFUSED" in res.stdout and "remount" in res.stdout, res.stdout + res.stderr
