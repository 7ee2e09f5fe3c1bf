"""What a compiled core would gain accl: a measured prototype (issue 13), against accl and raw mpi4py.

``bench/accl_core/acclcore.c`` does in C what accl's executor does in Python for a checked synchronous
call on an MPI group (header into the slot, small data in the payload, persistent all-gather of the
slots polled against a deadline, agreement check, then the payload reduction/copy or the blocking MPI
call).  Here it backs a minimal torch process group, "acclcore", whose Python methods keep the checks
accl's adapter makes before a plan; so the figures are what accl would cost with its adapter in Python
and the rest compiled.  Same job, same buffers' sizes, interleaved rounds: raw mpi4py, accl, acclcore.
The prototype covers SUM all_reduce, all_gather_into_tensor and even all_to_all_single, synchronous,
on contiguous CPU tensors; it is not part of torchhpc.

    python bench/accl_compiled_core.py [--np 2] [--repeats 7] [--time-per-point 0.4] [--check]

Outside an MPI job it compiles the module with the environment's ``mpicc`` (``MPICC`` overrides) into
``build/accl_core/`` and starts itself under ``mpiexec -n NP``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD = HERE.parent / "build" / "accl_core"
SIZES = [8, 64, 1024, 32 << 10, 1 << 20, 4 << 20]
COLLS = ("allreduce", "allgather", "alltoall")


def build() -> Path:
    """Compile acclcore.c with the environment's mpicc (skipped when up to date)."""
    src = HERE / "accl_core" / "acclcore.c"
    out = BUILD / ("acclcore" + sysconfig.get_config_var("EXT_SUFFIX"))
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    mpicc = os.environ.get("MPICC") or str(Path(sys.executable).parent / "mpicc")
    BUILD.mkdir(parents=True, exist_ok=True)
    cmd = [mpicc, "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", f"-I{sysconfig.get_paths()['include']}",
           str(src), "-o", str(out)]
    subprocess.run(cmd, check=True)
    return out


def _group_class():
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    sys.path.insert(0, str(BUILD))
    import acclcore  # noqa: PLC0415 - built above

    from torchhpc.accl import wire

    codes = {d: wire.dtype_code(d) for d in (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8)}
    sum_op = dist.ReduceOp.SUM

    def _one(tensors: list, what: str) -> torch.Tensor:
        t = tensors[0] if type(tensors) is list and len(tensors) == 1 else None
        if type(t) is not torch.Tensor or t.is_sparse:
            raise ValueError(f"acclcore: {what} takes exactly one dense tensor")
        return t

    def _cpu(t: torch.Tensor, what: str) -> int:
        if not (t.is_cpu and t.is_contiguous()):
            raise NotImplementedError(f"acclcore prototype: {what} of contiguous CPU tensors only")
        code = codes.get(t.dtype)
        if code is None:
            raise NotImplementedError(f"acclcore prototype: {what} of {t.dtype}")
        return code

    def _sync(opts: object, what: str) -> None:
        if opts is None or opts.asyncOp:  # type: ignore[attr-defined]
            raise NotImplementedError(f"acclcore prototype: synchronous {what} only")

    def _pair(output: torch.Tensor, input: torch.Tensor, opts: object, what: str) -> int:  # noqa: A002
        """Checks of a synchronous output/input call; the input's wire dtype code."""
        _sync(opts, what)
        if type(output) is not torch.Tensor or type(input) is not torch.Tensor or output.dtype != input.dtype:
            raise TypeError(f"acclcore: {what} needs two tensors of one dtype")
        _cpu(output, what)
        return _cpu(input, what)

    class CoreGroup(dist.ProcessGroup):
        """torch's adapter in Python (the checks accl makes before a plan), the rest in acclcore."""

        def __init__(self, rank: int, size: int, timeout_s: float) -> None:
            super().__init__(rank, size)
            self._comm, self._ctl = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
            self._core = acclcore.Core(MPI._handleof(self._comm), MPI._handleof(self._ctl), timeout_s)
            self._seq = 0
            self._size = size

        def getBackendName(self) -> str:  # noqa: N802
            return "acclcore"

        def allreduce(self, tensors, opts=None):
            t = _one(tensors, "all_reduce")
            _sync(opts, "all_reduce")
            if opts.reduceOp != sum_op:
                raise NotImplementedError("acclcore prototype: SUM only")
            code = _cpu(t, "all_reduce")
            self._seq += 1
            self._core.all_reduce(t.data_ptr(), t.numel(), code, self._seq)

        def all_gather_single(self, output, input, opts=None):  # noqa: A002
            code = _pair(output, input, opts, "all_gather_into_tensor")
            if output.numel() != self._size * input.numel():
                raise ValueError("acclcore: all_gather_into_tensor output must be world_size x input")
            self._seq += 1
            self._core.all_gather(input.data_ptr(), output.data_ptr(), input.nbytes, code, input.numel(), self._seq)

        _allgather_base = all_gather_single

        def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
            code = _pair(output, input, opts, "all_to_all_single")
            if output_split_sizes or input_split_sizes:
                raise NotImplementedError("acclcore prototype: even all_to_all only")
            if output.numel() != input.numel() or input.numel() % self._size:
                raise ValueError("acclcore: all_to_all_single needs equal, evenly divisible buffers")
            self._seq += 1
            self._core.all_to_all(input.data_ptr(), output.data_ptr(), input.nbytes, code, input.numel(), self._seq)

        alltoall_base = all_to_all_single

    return CoreGroup


def _runners(coll: str, nbytes: int, p: int, core_group, comm) -> dict:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    numel = max(p, nbytes // 4)
    ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    impls = ("mpi4py", "accl", "acclcore")
    groups = {"accl": dist.group.WORLD, "acclcore": core_group}
    out = {}
    if coll == "allreduce":
        b = {k: torch.ones(numel) for k in impls}
        a = b["mpi4py"].numpy()
        out["mpi4py"] = lambda: comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM)
        for k in ("accl", "acclcore"):
            out[k] = lambda k=k: dist.all_reduce(b[k], group=groups[k])
    else:
        per = numel // p
        ins = {k: torch.ones(per if coll == "allgather" else per * p) for k in impls}
        outs = {k: torch.empty(per * p) for k in impls}
        si, so = ins["mpi4py"].numpy(), outs["mpi4py"].numpy()
        if coll == "allgather":
            out["mpi4py"] = lambda: comm.Allgather(si, so)
            for k in ("accl", "acclcore"):
                out[k] = lambda k=k: ag(outs[k], ins[k], group=groups[k])
        else:
            out["mpi4py"] = lambda: comm.Alltoall(si, so)
            for k in ("accl", "acclcore"):
                out[k] = lambda k=k: dist.all_to_all_single(outs[k], ins[k], group=groups[k])
    return out


def _check(core_group, comm) -> None:
    """The prototype's results equal accl's (so the figures time correct work)."""
    import torch
    import torch.distributed as dist

    r, p = comm.Get_rank(), comm.Get_size()
    ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch >= 2.13 name
    for n in (2, 1 << 16):
        x = torch.arange(n * p, dtype=torch.float32) + r
        y = x.clone()
        dist.all_reduce(x)
        dist.all_reduce(y, group=core_group)
        assert torch.equal(x, y), "all_reduce differs"
        g1, g2 = torch.empty(n * p * p), torch.empty(n * p * p)
        ag(g1, x)
        ag(g2, x, group=core_group)
        assert torch.equal(g1, g2), "all_gather differs"
        a1, a2 = torch.empty(n * p), torch.empty(n * p)
        dist.all_to_all_single(a1, x)
        dist.all_to_all_single(a2, x, group=core_group)
        assert torch.equal(a1, a2), "all_to_all differs"


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from mpi4py import MPI

    import torchhpc.accl  # noqa: F401  (registers "accl")
    from torchhpc.accl.bench import mean_call_time

    comm = MPI.COMM_WORLD.Dup()
    rank, p = comm.Get_rank(), comm.Get_size()
    from torchhpc.waiting import agreed

    with agreed(comm, 300.0, "building the acclcore prototype"):
        if rank == 0:  # started under mpiexec directly: build here (a no-op when up to date)
            build()
    group_class = _group_class()
    dist.Backend.register_backend(
        "acclcore", lambda store, r, n, timeout: group_class(r, n, timeout.total_seconds()), devices=["cpu"])
    dist.init_process_group("accl")
    core_group = dist.new_group(backend="acclcore")
    _check(core_group, comm)
    if args.check:
        if rank == 0:
            print(f"acclcore prototype: results equal accl's on {p} ranks")
        dist.destroy_process_group()
        comm.Free()
        return 0
    impls = ("mpi4py", "accl", "acclcore")
    if rank == 0:
        print(f"# {p} ranks; us per call: median of {args.repeats} interleaved rounds [min-max]; "
              f"ratio = raw mpi4py time / impl time, median round")
        print(f"{'collective':>10} {'size':>8} | {'mpi4py':>20} | {'accl':>20} | {'acclcore':>20} | "
              f"{'accl +us':>8} {'core +us':>8} | {'accl x':>6} {'core x':>6}")
    for coll in COLLS:
        for size in (s for s in SIZES if args.min_bytes <= s <= args.max_bytes):
            fns = _runners(coll, size, p, core_group, comm)
            rounds = {k: [] for k in impls}
            for _ in range(args.repeats):
                for k in impls:
                    rounds[k].append(mean_call_time(fns[k], comm, args.time_per_point / args.repeats, max_iters=20000))
            if rank == 0:
                med = {k: statistics.median(v) for k, v in rounds.items()}
                cells = " | ".join(f"{med[k] * 1e6:8.2f} [{min(rounds[k]) * 1e6:.1f}-{max(rounds[k]) * 1e6:.1f}]"
                                   .rjust(20) for k in impls)
                ratio = {k: statistics.median(m / a for m, a in zip(rounds["mpi4py"], rounds[k], strict=True))
                         for k in ("accl", "acclcore")}
                print(f"{coll:>10} {size:>8} | {cells} | {(med['accl'] - med['mpi4py']) * 1e6:8.2f} "
                      f"{(med['acclcore'] - med['mpi4py']) * 1e6:8.2f} | {ratio['accl']:6.2f} "
                      f"{ratio['acclcore']:6.2f}", flush=True)
    dist.destroy_process_group()
    comm.Free()
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--time-per-point", type=float, default=0.4, help="seconds per size and impl, all rounds")
    ap.add_argument("--max-bytes", type=int, default=SIZES[-1])
    ap.add_argument("--min-bytes", type=int, default=SIZES[0])
    ap.add_argument("--check", action="store_true", help="build, check results against accl, time nothing")
    args = ap.parse_args(argv)
    from torchhpc.accl.rendezvous import under_mpi_launcher

    if under_mpi_launcher():
        return run(args)
    build()
    from torchhpc.mpirun import available_cores, local_job_env, mpiexec_argv

    env = local_job_env(oversubscribed=args.np > available_cores())  # no yield-when-idle unless oversubscribed
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return subprocess.call(mpiexec_argv(args.np, [sys.executable, __file__, *argv]), env=env)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
