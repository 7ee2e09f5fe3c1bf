"""Single-process tests of torchhpc.braid: solver settings, hierarchy, errors, GRUSerial, layer helpers."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

from torchhpc.braid import GRUSerial, LayerParallel, MGRITOptions, ODEBlock, solve
from torchhpc.braid.grid import Hierarchy, even_split


def _dahlquist(lam: float = -1.0):
    def step(u: torch.Tensor, t0: float, t1: float) -> torch.Tensor:
        return u / (1 - (t1 - t0) * lam)
    return step


def _serial(step, u0, t):
    out = [u0]
    for a, b in zip(t[:-1], t[1:], strict=True):
        out.append(step(out[-1], a, b))
    return out


T = [5.0 * i / 64 for i in range(65)]
U0 = torch.tensor([1.0, 0.5], dtype=torch.float64)


def test_even_split_and_hierarchy_ownership() -> None:
    assert even_split(10, 4) == [3, 3, 2, 2]
    h = Hierarchy(33, [9, 8, 8, 8], [2], max_levels=10, min_coarse=3)
    assert h.sizes == [33, 17, 9, 5, 3] and h.strides == [1, 2, 4, 8, 16]
    lv = h.level(2, 1)  # fine points 9..16 -> level-2 points 3, 4 (fine 12, 16)
    assert (lv.lo, lv.hi, lv.prev_owner, lv.next_owner) == (3, 5, 0, 2)
    top = h.level(4, 1)  # level-4 point 1 is fine point 16 (rank 1); point 2 is fine 32 (rank 3)
    assert (top.lo, top.hi, top.next_owner) == (1, 2, 3) and h.level(4, 2).empty
    assert h.owner(16) == 1 and h.level(4, 3).lo == 2
    with pytest.raises(ValueError, match="does not split"):
        Hierarchy(10, [5, 4], [2], 3)


@pytest.mark.parametrize("settings", [
    dict(max_levels=3, cfactor=2, relax="F"),
    dict(max_levels=3, cfactor=[4, 2], relax=["FCF", "F"], cycle="F"),
    dict(max_levels=4, cfactor=2, relax=2, skip_downcycle=True, nested_iteration=False),
    dict(max_levels=2, cfactor=8, relax="FCF", weight_c=1.3, nested_iteration=False),
])
def test_solve_settings_converge_to_time_stepping(settings) -> None:
    step = _dahlquist()
    res = solve(step, U0, T, MPI.COMM_SELF, tol=1e-11, max_iter=40, **settings)
    assert res.converged and res.residuals[-1] < 1e-11
    ref = _serial(step, U0, T)
    for j, u in zip(res.index, res.u, strict=True):
        assert float((u - ref[j]).abs().max()) < 1e-9
    assert res.t == T and res.index == list(range(len(T)))


def test_relative_tolerance_and_max_iter() -> None:
    res = solve(_dahlquist(), U0, T, MPI.COMM_SELF, max_levels=3, tol=0.0, rtol=1e-3, max_iter=50,
                nested_iteration=False)
    assert res.converged and res.residuals[-1] < 1e-3 * res.residuals[0] <= res.residuals[-2]
    capped = solve(_dahlquist(), U0, T, MPI.COMM_SELF, max_levels=3, tol=0.0, max_iter=2,
                   nested_iteration=False)
    assert capped.iterations == 2 and not capped.converged


def test_min_coarse_limits_levels_and_step_counts() -> None:
    res = solve(_dahlquist(), U0, T, MPI.COMM_SELF, max_levels=10, cfactor=4, min_coarse=5, max_iter=1)
    assert res.levels == 3  # 65 -> 17 -> 5 (next would be 2 < 5)
    one = solve(_dahlquist(), U0, T, MPI.COMM_SELF, max_levels=1)
    assert one.steps == one.critical_path == len(T) - 1


def test_solve_rejects_bad_arguments() -> None:
    step = _dahlquist()
    with pytest.raises(ValueError, match="cfactor"):
        solve(step, U0, T, MPI.COMM_SELF, cfactor=1)
    with pytest.raises(ValueError, match="relax"):
        solve(step, U0, T, MPI.COMM_SELF, relax="FFC")
    with pytest.raises(ValueError, match="cycle"):
        solve(step, U0, T, MPI.COMM_SELF, cycle="W")
    with pytest.raises(ValueError, match="increasing"):
        solve(step, U0, [0.0, 1.0, 0.5], MPI.COMM_SELF)
    with pytest.raises(ValueError, match="max_iter"):
        MGRITOptions.build(max_iter=0)


def test_gru_serial_equals_torch_gru() -> None:
    ser = GRUSerial(3, 5, seed=1, dtype=torch.float64)
    ref = nn.GRU(3, 5, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.weight_ih_l0.copy_(ser.cell.weight_ih)
        ref.weight_hh_l0.copy_(ser.cell.weight_hh)
        ref.bias_ih_l0.copy_(ser.cell.bias_ih)
        ref.bias_hh_l0.copy_(ser.cell.bias_hh)
    x = torch.randn(2, 7, 3, dtype=torch.float64)
    y, h = ser(x)
    yr, hr = ref(x)
    assert torch.allclose(y, yr, atol=1e-14) and torch.allclose(h, hr[0], atol=1e-14)


class _StepDt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor, dt: float) -> torch.Tensor:
        return x + dt * torch.sin(self.lin(x))


def test_layer_parallel_settings_and_serial_twin() -> None:
    lp = LayerParallel(MPI.COMM_SELF, [nn.Linear(3, 3, dtype=torch.float64), _StepDt], [4, 4], Tf=2.0,
                       max_fwd_levels=2, max_bwd_levels=3, max_iters=7)
    lp.setCFactor(4)
    lp.setCFactor(2, level=1)
    lp.setFwdNumRelax("F")
    lp.setBwdNumRelax(2, level=0)
    lp.setAbsTol(1e-12)
    lp.setBwdRelTol(1e-3)
    lp.setSkipDowncycle(True)
    lp.setNestedIteration()
    lp.setFMG()  # XBraid's FMG: F-cycles
    assert lp.fwd_opts.cycle == lp.bwd_opts.cycle == "F"
    lp.setFMG(False)
    assert lp.fwd_opts.cycle == "V"
    lp.setCycle("F")
    lp.setCRelaxWt(1.0)
    lp.setFwdMaxIters(9)
    assert lp.fwd_opts.cfactor == [4, 2] and lp.bwd_opts.cfactor == [4, 2]
    assert lp.fwd_opts.relax == [0] and lp.bwd_opts.relax == [2]
    assert (lp.fwd_opts.max_iter, lp.bwd_opts.max_iter) == (9, 7)
    assert lp.bwd_opts.rtol == 1e-3 and lp.fwd_opts.nested_iteration and lp.bwd_opts.skip_downcycle
    with pytest.raises(ValueError):
        lp.setCycle("W")
    with pytest.raises(ValueError):
        lp.setMaxIters(0)
    x = torch.randn(4, 3, dtype=torch.float64)
    y = lp(x)
    y.sum().backward()
    seq = lp.build_sequential_on_root()
    assert isinstance(seq[0], ODEBlock) and isinstance(seq[5], ODEBlock) and len(seq) == 8
    assert torch.allclose(seq(x), y, atol=1e-10)
    its, res = lp.getFwdStats()
    assert its >= 1 and len(res) == its and lp.getBwdStats()[0] >= 1
    assert lp.getTimers()["forward"] > 0 and "backward=" in lp.getTimersString()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_layer_parallel_on_cuda_matches_cpu() -> None:
    lp = LayerParallel(MPI.COMM_SELF, [lambda: nn.Linear(3, 3, dtype=torch.float64)], [6], Tf=1.0,
                       max_fwd_levels=2, max_bwd_levels=2, max_iters=10)
    x = torch.randn(4, 3, dtype=torch.float64)
    y_cpu = lp(x)
    lp.to("cuda")
    y_gpu = lp(x.cuda())
    assert y_gpu.is_cuda and torch.allclose(y_gpu.cpu(), y_cpu, atol=1e-12)


def test_channel_round_trips_dtypes_and_times_out() -> None:
    from torchhpc.braid.transport import Channel

    ch = Channel(MPI.COMM_SELF.Dup(), timeout=0.3)
    tensors = [torch.randn(3, 4, dtype=torch.float64), torch.randn(2, dtype=torch.bfloat16),
               torch.tensor(True), torch.arange(6, dtype=torch.int32).reshape(2, 3)[:, 1:]]
    ch.tick(5)
    for t in tensors:
        ch.send(t, 0, tag=7)
    ch.clock = 0
    for t in tensors:
        got = ch.recv(0, tag=7)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    ch.flush()
    assert ch.clock == 5  # a receive advances the logical clock to the sender's
    with pytest.raises(TimeoutError, match="receive from rank 0"):
        ch.recv(0, tag=8)
    ch.comm.Free()


def test_custom_partition_is_accepted_and_checked() -> None:
    res = solve(_dahlquist(), U0, T, MPI.COMM_SELF, max_levels=3, partition=[len(T)], tol=1e-10)
    assert res.converged and res.index == list(range(len(T)))
    with pytest.raises(ValueError, match="does not split"):
        solve(_dahlquist(), U0, T, MPI.COMM_SELF, partition=[len(T) - 1])


class _Scaled(nn.Module):
    """A step whose forward takes an extra argument and keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor, shift: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.tanh(self.lin(x) + shift)


def test_extra_args_reach_every_layer_and_print_level(capsys) -> None:
    lp = LayerParallel(MPI.COMM_SELF, [_Scaled], [8], Tf=1.0, max_fwd_levels=3, max_bwd_levels=3,
                       max_iters=20)
    lp.setAbsTol(1e-13)
    lp.setPrintLevel(1)
    shift = torch.full((3,), 0.3, dtype=torch.float64)
    x = torch.randn(5, 3, dtype=torch.float64)
    y = lp(x, shift, scale=2.0)
    assert "MGRIT iter" in capsys.readouterr().out
    ref = x
    for layer in lp.build_sequential_on_root():
        ref = layer(ref, shift, scale=2.0)
    assert torch.allclose(y, ref, atol=1e-12)
    assert not torch.allclose(lp(x, shift, scale=1.0), y)


def test_timeout_settings_are_checked(monkeypatch) -> None:
    from torchhpc.braid import transport

    monkeypatch.delenv("TORCHHPC_BRAID_TIMEOUT", raising=False)
    assert transport.default_timeout() == transport.DEFAULT_TIMEOUT == 300.0
    monkeypatch.setenv("TORCHHPC_BRAID_TIMEOUT", "12.5")
    assert transport.check_timeout(None) == 12.5
    assert LayerParallel(MPI.COMM_SELF, [nn.Identity()], [2], Tf=1.0).timeout == 12.5
    monkeypatch.setenv("TORCHHPC_BRAID_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="TORCHHPC_BRAID_TIMEOUT='soon': .* takes a number"):
        transport.default_timeout()
    with pytest.raises(ValueError, match="timeout must be > 0"):
        solve(_dahlquist(), U0, T, MPI.COMM_SELF, timeout=0)
    with pytest.raises(ValueError, match="op must be one of"):
        transport.allreduce(MPI.COMM_SELF, 1.0, "prod", 1.0)
    with pytest.raises(ValueError, match="not a permutation"):
        transport.Channel(MPI.COMM_SELF, 1.0, order=[1])


def test_self_collectives_round_trip() -> None:
    from torchhpc.braid import transport
    from torchhpc.runtime import waiting

    comm = MPI.COMM_SELF
    assert transport.allreduce(comm, 3, "max", 1.0) == 3
    assert transport.allgather_int(comm, 7, 1.0) == [7]
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(transport.bcast_tensor(comm, t, 0, (2, 3), torch.float32, "cpu", 1.0), t)
    with pytest.raises(ValueError, match="differs from the expected"):
        transport.bcast_tensor(comm, t, 0, (3, 2), torch.float32, "cpu", 1.0)
    assert transport.bcast_object(comm, {"k": [1, 2]}, 0, 1.0) == {"k": [1, 2]}
    assert transport.gather_object(comm, ("x", 1), 0, 1.0) == [("x", 1)]
    waiting.barrier(comm, 1.0, "barrier")  # braid's barrier is the package's one
    transport.dup(comm, 1.0).Free()


# ---------------------------------------------------------------------------- engine="xbraid"
def test_xbraid_missing_extension_names_make_native() -> None:
    """Where the extension does not import, engine='xbraid' raises EngineUnavailableError naming it and the
    make target, on solve and on LayerParallel, and location() is None."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['_torchhpc_xbraid'] = None  # as if not built\n"
            "import torch; from mpi4py import MPI; from torch import nn\n"
            "from torchhpc.braid import LayerParallel, solve, xbraid\n"
            "from torchhpc.runtime.errors import EngineUnavailableError\n"
            "try:\n"
            "    solve(lambda u, a, b: u, torch.ones(1), [0.0, 1.0, 2.0], MPI.COMM_SELF, engine='xbraid')\n"
            "except EngineUnavailableError as e:\n"
            "    print('ERR', e)\n"
            "try:\n"
            "    LayerParallel(MPI.COMM_SELF, [nn.Identity()], [2], Tf=1.0, engine='xbraid')\n"
            "except EngineUnavailableError as e:\n"
            "    print('LPERR', e)\n"
            "print('LOC', xbraid.location())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR the native xbraid engine (torchhpc.braid engine='xbraid') is not available" in out.stdout
    assert "_torchhpc_xbraid" in out.stdout and "make native-xbraid" in out.stdout
    assert "LPERR the native xbraid engine" in out.stdout and "LOC None" in out.stdout


def test_xbraid_adaptor_packs_and_sums_exactly() -> None:
    """The braid-vector operations (pure Python, no extension needed): buffer round trip, AXPY, message size."""
    from torchhpc.braid.xbraid import Adaptor

    u0 = torch.zeros(3, 4, dtype=torch.float64)
    ad = Adaptor(lambda u, a, b: u, u0, lambda j: torch.zeros(3, 4, dtype=torch.float64), u0.numel() * 8)
    buf = bytearray(ad.bufsize)
    x = torch.randn(4, 3, dtype=torch.float64).t()  # non-contiguous on purpose
    assert ad.pack(x, memoryview(buf)) == ad.bufsize
    assert torch.equal(ad.unpack(memoryview(buf)), x)
    small = torch.randn(2, dtype=torch.float32)
    n = ad.pack(small, memoryview(buf))
    assert n < ad.bufsize and torch.equal(ad.unpack(memoryview(buf)), small)
    with pytest.raises(ValueError, match="does not fit"):
        ad.pack(torch.zeros(5, 5, dtype=torch.float64), memoryview(buf))
    y = torch.randn(3, 4, dtype=torch.float64)
    x = x.contiguous()
    assert torch.equal(Adaptor.sum(1.0, x, -1.0, y), x - y) and torch.equal(Adaptor.sum(1.0, x, 0.0, y), x)
    assert torch.equal(Adaptor.sum(-1.0, x, 1.0, y), y - x)
    before = y.clone()
    Adaptor.sum(2.0, x, 3.0, y)
    assert torch.equal(y, before)  # vectors are immutable: XBraid never writes into a caller's tensor
    assert torch.equal(ad.unpack(memoryview(bytearray(ad.bufsize))), u0)  # a failed peer's empty message


def test_xbraid_callback_error_and_options_on_one_rank() -> None:
    from torchhpc.braid import xbraid

    if xbraid.location() is None:
        pytest.skip("the XBraid extension is not built (run `make native`)")
    step = _dahlquist()

    def bad(u: torch.Tensor, t0: float, t1: float) -> torch.Tensor:
        if t1 > 3.0:
            raise KeyError("no step past t=3")
        return step(u, t0, t1)

    with pytest.raises(KeyError, match="no step past"):
        solve(bad, U0, T, MPI.COMM_SELF, engine="xbraid", max_levels=3)
    with pytest.raises(TypeError, match="must return a torch.Tensor"):
        solve(lambda u, a, b: 1.0, U0, T, MPI.COMM_SELF, engine="xbraid", max_levels=3)
    res = solve(step, U0, T, MPI.COMM_SELF, engine="xbraid", max_levels=3, relax="F", tol=1e-11, max_iter=40)
    assert res.converged and res.index == list(range(len(T))) and res.t == T
    ref = _serial(step, U0, T)
    assert max(float((u - ref[j]).abs().max()) for j, u in zip(res.index, res.u, strict=True)) < 1e-9
    one = solve(step, U0, T, MPI.COMM_SELF, engine="xbraid", max_levels=1)
    assert one.levels == 1 and max(float((u - ref[j]).abs().max()) for j, u in enumerate(one.u)) < 1e-14
