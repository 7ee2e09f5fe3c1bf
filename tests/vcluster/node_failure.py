"""Collective traffic on accl until a peer fails; every survivor must raise the package's error in time.

tests/test_vcluster.py runs it as a 2-node Slurm job and tears one node down while the loop runs; the fault
soak (tests/vcluster/soak.py) runs each of its workloads for a number of steps on 4 nodes and injects its
faults.  Workloads: ``allreduce`` (accl all-reduces), ``rehearsal`` (a rehearsal buffer sampling across every
rank, its default transport), ``chunkstore`` (remote gathers of a ChunkTensor sharded over the nodes).  Each
rank prints ``LOOPING`` once it has done 20 steps, ``DONE`` after ``--steps`` (0: loop until failure), and on
the failure one ``SURVIVOR`` line: how long after its last completed step the error came, the CPU time the
process (every thread) used in that wait, and which error it was.  A rank still inside one step three
timeouts later prints every thread's stack (to tell a stuck survivor from a slow one)."""

import argparse
import faulthandler
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from torchhpc.launcher import init_distributed
from torchhpc.runtime.errors import TorchhpcError

Workload = tuple[Callable[[int], None], Callable[[], None]]  # one step, and the collective close at the end


def allreduce_step(timeout: float) -> Workload:
    x = torch.ones(4096)

    def step(_: int) -> None:
        dist.all_reduce(x)
        x.fill_(1.0)
    return step, lambda: None


def rehearsal_step(timeout: float) -> Workload:
    from mpi4py import MPI

    from torchhpc.rehearsal import RehearsalBuffer

    rank = MPI.COMM_WORLD.Get_rank()
    buf = RehearsalBuffer(num_classes=4, slots_per_class=16, num_candidates=8, num_representatives=8,
                          sample_shapes=(3, 32, 32), seed=rank, timeout=timeout, global_sampling=True)
    g = torch.Generator().manual_seed(rank)

    def step(i: int) -> None:
        buf.accumulate(torch.randn(8, 3, 32, 32, generator=g), torch.arange(8) % 4)
        batch = buf.wait()
        assert batch[0].shape[1:] == (3, 32, 32)
    return step, buf.close


def chunkstore_step(timeout: float) -> Workload:
    from torchhpc.chunkstore import ChunkTensor

    rows, width = 1 << 14, 64
    table = ChunkTensor((rows, width), torch.float32, capacity_per_device=0, timeout=timeout)
    table.load_from_tensor(torch.arange(rows, dtype=torch.float32).unsqueeze(1).expand(rows, width).contiguous()
                           if dist.get_rank() == 0 else None)
    g = torch.Generator().manual_seed(dist.get_rank())

    def step(_: int) -> None:
        ids = torch.randint(0, rows, (2048,), generator=g)
        got = table.index(ids)
        if not torch.equal(got[:, 0], ids.float()):  # exact rows, or the fault corrupted a gather
            raise AssertionError("a gathered row is not the row asked for")
    return step, table.close


WORKLOADS = {"allreduce": allreduce_step, "rehearsal": rehearsal_step, "chunkstore": chunkstore_step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("timeout", type=float, nargs="?", default=5.0, help="accl's (and the workload's) deadline, s")
    p.add_argument("stop_rank", type=int, nargs="?", default=-1, help="this rank SIGSTOPs itself after 20 steps")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="allreduce")
    p.add_argument("--steps", type=int, default=0, help="steps to run, then exit 0 (0: until a failure)")
    p.add_argument("--record", help="a directory every node sees: the SURVIVOR line also goes to survivor-RANK "
                   "there (stdout passes through the launcher, which the scheduler may kill first)")
    args = p.parse_args()
    info = init_distributed(backend="accl", timeout=args.timeout)
    host = socket.gethostname()
    step, close = WORKLOADS[args.workload](args.timeout)
    last_ok, cpu_ok = time.monotonic(), time.process_time()
    calls = 0
    try:
        while args.steps == 0 or calls < args.steps:
            faulthandler.dump_traceback_later(3 * args.timeout)  # re-armed for every step
            step(calls)
            calls += 1
            last_ok, cpu_ok = time.monotonic(), time.process_time()
            if calls == 20:
                print(f"LOOPING rank={info.rank} host={host}", flush=True)
                if info.rank == args.stop_rank:
                    os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(0.005)
        faulthandler.cancel_dump_traceback_later()
        close()
        print(f"DONE rank={info.rank} host={host} steps={calls}", flush=True)
    except Exception as exc:  # noqa: BLE001 - the test reads which error it was
        faulthandler.cancel_dump_traceback_later()
        waited, cpu = time.monotonic() - last_ok, time.process_time() - cpu_ok
        family = "torchhpc" if isinstance(exc, TorchhpcError) else "other"
        line = (f"SURVIVOR rank={info.rank} host={host} after={waited:.1f}s cpu={cpu:.1f}s family={family} "
                f"error={type(exc).__name__}: {str(exc).splitlines()[0][:400]}")
        print(line, flush=True)
        if args.record:
            with open(os.path.join(args.record, f"survivor-{info.rank}"), "w") as f:
                f.write(line + "\n")
        sys.exit(3)


if __name__ == "__main__":
    main()
