"""The Thallium transport of torchhpc.rehearsal in one process: the extension's reads, its lock, its errors.

Two engines in one process stand for two ranks, over ``na+sm`` (the same path as between two processes on a
node) and ``ofi+tcp`` (libfabric's TCP provider, the cross-node path; ``ofi+verbs``/``ofi+cxi`` need their NICs,
absent here); the transport under mpiexec is tested in tests/mpi/test_rehearsal.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from torchhpc.doctor import run_checks
from torchhpc.rehearsal import RehearsalBuffer
from torchhpc.rehearsal.thallium import MARGO_CONFIG
from torchhpc.runtime import native
from torchhpc.runtime.errors import EngineUnavailableError


def _extension():
    try:
        return native.load("thallium")
    except EngineUnavailableError as exc:
        pytest.skip(str(exc))


K, HEADER, RECORD, SLOTS = 2, 64, 192, 5
SECRET = bytes(range(32))  # the job's (rank 0's random bytes under mpiexec)


@pytest.fixture(params=["na+sm", "ofi+tcp"])
def pair(request: pytest.FixtureRequest):
    """Two transports ("ranks" 0 and 1) over one protocol, each exposing a block whose records hold known bytes."""
    ext = _extension()
    blocks = []
    for r in range(2):
        b = torch.zeros(HEADER + SLOTS * RECORD, dtype=torch.uint8)
        b[: 8 * K].view(torch.int64).copy_(torch.tensor([3 + r, 5 + r]))
        b[HEADER:].view(SLOTS, RECORD).copy_((torch.arange(SLOTS) + 10 * r + 1).view(SLOTS, 1).to(torch.uint8))
        blocks.append(b)
    trs = [ext.Transport(request.param, b.data_ptr(), b.numel(), HEADER, RECORD, K, MARGO_CONFIG, SECRET)
           for b in blocks]
    addresses = [t.address() for t in trs]
    for r, t in enumerate(trs):
        t.connect(addresses, r)
    yield ext, trs, blocks
    for t in trs:
        t.close()


def test_reads_return_the_owners_records_and_skip_our_own(pair) -> None:
    ext, (t0, t1), _ = pair
    assert t0.fills([1], 10.0).tolist() == [[4, 6]]
    label = np.zeros((6, 8), dtype=np.uint8)
    body = np.zeros((6, 100), dtype=np.uint8)
    ranks = np.array([1, 0, 1, 1, 1, 1])  # one own row (left alone), 5 remote records, a slot twice
    slots = np.array([4, 0, 0, 2, 2, 3])
    got = t0.read(ranks, slots, [(label, 0), (body, 64)], 10.0)
    assert got == 5 * (8 + 100)
    expected = slots + 11
    for i, r in enumerate(ranks):
        want = 0 if r == 0 else expected[i]  # our own rows are the caller's to fill
        assert (label[i] == want).all() and (body[i] == want).all()


def test_a_read_waits_for_the_owners_update_lock(pair) -> None:
    """The owner's exclusive lock holds serving off: a record is never pushed while it is rewritten."""
    _, (t0, t1), blocks = pair
    out = np.zeros((1, RECORD), dtype=np.uint8)
    t1.lock_exclusive()
    try:
        reader = threading.Thread(target=t0.read, args=(np.array([1]), np.array([2]), [(out, 0)], 30.0))
        reader.start()
        time.sleep(0.3)
        assert reader.is_alive(), "a read completed while the owner held its update lock"
        blocks[1][HEADER + 2 * RECORD : HEADER + 3 * RECORD] = 77  # the "update", under the lock
    finally:
        t1.unlock_exclusive()
    reader.join(30)
    assert not reader.is_alive()
    assert (out == 77).all(), "the read saw the record from before the update"


def test_an_engine_without_the_jobs_secret_gets_no_data(pair) -> None:
    """Anyone who reaches an owner's port (another user's process on the network) is refused, not served."""
    ext, (t0, t1), blocks = pair
    outsider_block = torch.zeros(HEADER + SLOTS * RECORD, dtype=torch.uint8)
    protocol = t0.address().split("://")[0]  # the pair's, as Mercury names it in addresses
    outsider = ext.Transport(protocol, outsider_block.data_ptr(),
                             outsider_block.numel(), HEADER, RECORD, K, MARGO_CONFIG, bytes(32))
    try:
        outsider.connect([outsider.address(), t1.address()], 0)
        with pytest.raises(ext.PeerError, match="refused a fill-count request.*secret"):
            outsider.fills([1], 10.0)
        out = np.zeros((1, RECORD), dtype=np.uint8)
        with pytest.raises(ext.PeerError, match="refused a record read.*not a rank of this job"):
            outsider.read(np.array([1]), np.array([2]), [(out, 0)], 10.0)
        assert not out.any(), "the outsider received record bytes"
    finally:
        outsider.close()
    assert t0.fills([1], 10.0).tolist() == [[4, 6]], "the job's own ranks are still served"
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ext.Transport("na+sm", outsider_block.data_ptr(), outsider_block.numel(), HEADER, RECORD, K, MARGO_CONFIG, b"")


def test_request_ranges_are_checked_without_overflow() -> None:
    """An owner checks every range a request names before any transfer; sums and products that wrap around
    2**64 (a crafted request) are refused, not taken for small numbers."""
    ext = _extension()
    big = 2**64 - 8
    assert ext.ranges_fit([0, 1], [0], [8], [0], 192, 16)
    assert not ext.ranges_fit([0, 2], [0], [8], [0], 192, 16)  # row 2 lies past the region
    assert not ext.ranges_fit([0], [big], [16], [0], 192, 16)  # offset + nbytes wraps to 8
    assert not ext.ranges_fit([0], [0], [8], [big], 192, 16)  # base + nbytes wraps
    assert not ext.ranges_fit([2**61], [0], [8], [0], 192, 16)  # row * nbytes wraps to 0
    assert not ext.ranges_fit([0], [0, 8], [8], [0], 192, 16)  # field lists of different lengths


def test_bad_slot_and_closed_peer_are_clear_errors(pair) -> None:
    ext, (t0, t1), _ = pair
    out = np.zeros((1, RECORD), dtype=np.uint8)
    with pytest.raises(ext.PeerError, match="slot out of range"):
        t0.read(np.array([1]), np.array([SLOTS]), [(out, 0)], 10.0)
    with pytest.raises(ValueError, match="outside the record"):
        t0.read(np.array([1]), np.array([0]), [(out, 64)], 10.0)
    t1.close()
    t0_start = time.perf_counter()
    # Mercury either reports the closed engine (na+sm: no such peer) or the request runs into its deadline.
    with pytest.raises((ext.PeerTimeout, ext.PeerUnreachable), match="rank 1 (did not answer|is unreachable)"):
        t0.fills([1], 0.5)
    assert time.perf_counter() - t0_start < 10


def test_missing_extension_is_engine_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(native.ENGINES, "thallium", native.NativeEngine(
        "thallium", "_torchhpc_thallium_not_built", "make native-mochi", "RehearsalBuffer(transport='thallium')"))
    with pytest.raises(EngineUnavailableError, match=r"_torchhpc_thallium_not_built.*make native-mochi"):
        RehearsalBuffer(2, 3, 2, 2, (4,), transport="thallium")
    doctor = {c.name: c for c in run_checks(probe=False)}["native engines"]
    assert "thallium not built" in doctor.value and "make native-mochi" in doctor.hint


def test_every_engine_is_in_the_doctor_line() -> None:
    doctor = {c.name: c for c in run_checks(probe=False)}["native engines"]
    for name in native.ENGINES:
        assert f"{name} " in doctor.value


def test_doctor_says_where_the_extension_was_loaded_from() -> None:
    ext = _extension()
    doctor = {c.name: c for c in run_checks(probe=False)}["native engines"]
    assert doctor.status == "OK" and f"thallium {ext.__file__}" in doctor.value


def test_transport_options_are_checked() -> None:
    with pytest.raises(ValueError, match="transport must be one of"):
        RehearsalBuffer(2, 3, 2, 2, (4,), transport="ucx")
    with pytest.raises(ValueError, match="protocol must be one of"):
        RehearsalBuffer(2, 3, 2, 2, (4,), transport="thallium", protocol="tcp")
    with pytest.raises(ValueError, match="applies to transport='thallium' only"):
        RehearsalBuffer(2, 3, 2, 2, (4,), protocol="na+sm")


def test_single_rank_buffer_over_thallium_keeps_labels_with_samples() -> None:
    _extension()
    with RehearsalBuffer(3, 4, 4, 6, (2, 3), seed=1, transport="thallium", protocol="na+sm") as buf:
        assert buf.storage.protocol == "na+sm" and buf.storage.addresses[0].startswith("na+sm://")
        for step in range(6):
            y = torch.arange(6) % 3
            x = (y + 10 * (torch.arange(6) + 6 * step)).double().view(6, 1, 1).expand(6, 2, 3).float().contiguous()
            buf.accumulate(x, y)
            out = buf.wait()
            flat = out.samples.reshape(out.samples.shape[0], -1)
            assert (flat == flat[:, :1]).all() and torch.equal(flat[:, 0].long() % 10, out.targets)



_STALLED_PEERS = r"""
import sys, time
import numpy as np, torch
from torchhpc.rehearsal.thallium import MARGO_CONFIG
from torchhpc.runtime import native
ext = native.load("thallium")
K, HEADER, RECORD, SLOTS = 2, 64, 192, 5
blocks = [torch.zeros(HEADER + SLOTS * RECORD, dtype=torch.uint8) for _ in range(3)]
trs = [ext.Transport(sys.argv[1], b.data_ptr(), b.numel(), HEADER, RECORD, K, MARGO_CONFIG, bytes(range(32)))
       for b in blocks]
for r, t in enumerate(trs):
    t.connect([t.address() for t in trs], r)
for t in trs[1:]:
    t.lock_exclusive()  # an owner whose handlers wait for its lock answers nothing: a stuck peer
out = np.zeros((2, RECORD), dtype=np.uint8)
for name, call in (("fills", lambda: trs[0].fills([1, 2], 1.0)),
                   ("read", lambda: trs[0].read(np.array([1, 2]), np.array([0, 0]), [(out, 0)], 1.0))):
    start = time.perf_counter()
    try:
        call()
    except ext.PeerTimeout as exc:
        print(f"{name}: {time.perf_counter() - start:.2f} s: {exc}", flush=True)
trs[0].close()  # the reader gives up and leaves before the stuck owners come back
start = time.perf_counter()
for t in trs[1:]:
    t.unlock_exclusive()
for t in trs[1:]:
    t.close()
print(f"owners closed in {time.perf_counter() - start:.2f} s", flush=True)
print("exited normally", flush=True)
"""


@pytest.mark.parametrize("protocol", ["na+sm", "ofi+tcp"])
def test_two_stuck_owners_are_one_timeout_not_an_abort(protocol: str) -> None:
    """A draw from two owners that both stop answering raises the package's timeout for the first, within the
    deadline and naming it, after awaiting the second: an answer left unawaited made thallium's destructor throw
    its own timeout inside a noexcept destructor, and the process ended in std::terminate (SIGABRT).  The owners,
    back after the reader left, close in seconds: their answers to it are cancelled, not retried for minutes."""
    _extension()
    proc = subprocess.run([sys.executable, "-c", _STALLED_PEERS, protocol], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for name, what in (("fills", "a fill-count request"), ("read", "a record read")):
        line = next((x for x in lines if x.startswith(f"{name}: ")), None)
        assert line is not None, proc.stdout + proc.stderr[-3000:]
        assert f"rank 1 did not answer {what} within the 1 s deadline" in line, line
        assert 0.9 < float(line.split()[1]) < 10, line
    # the owners' late answers to the reader that left were cancelled at its deadline, not retried by Mercury for
    # NA_OFI_OP_RETRY_TIMEOUT (120 s each over TCP) while their close waited
    closed = next(x for x in lines if x.startswith("owners closed in "))
    assert float(closed.split()[3]) < 15, closed
    assert lines[-1] == "exited normally", proc.stdout
