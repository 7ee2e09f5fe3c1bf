"""chunkstore's node-shared host tier against a plain tensor at the same page size, and what the page size buys.

One process (one rank: every row in the node-shared host tier, one mapping) gathers ``--gather`` random rows of
``--row-bytes`` from a table of ``--rows`` rows, into a preallocated output, four ways, in interleaved rounds:

* ``plain-4k`` / ``plain-2m``: ``torch.index_select`` on an ordinary private tensor whose memory is advised
  ``MADV_NOHUGEPAGE`` / ``MADV_HUGEPAGE`` (checked in smaps: AnonHugePages);
* ``chunk-4k``: ``ChunkTensor.index`` with its segment in ``/dev/shm`` as this machine mounts it;
* ``chunk-2m``: the same with the segment on ``--huge-dir``, a tmpfs mounted ``huge=advise`` (only with the
  option; the page size each tier really got is read from smaps and printed).

    python bench/host_tier.py                               # plain-4k, plain-2m, chunk-<what /dev/shm gives>
    unshare -m sh -c 'mount -t tmpfs -o huge=advise,size=1g tmpfs /mnt && python bench/host_tier.py --huge-dir /mnt'

The ratios compare each chunk tier with the plain tensor of the same page size (target: >= 0.95), and the plain
tensor's two page sizes (what 2 MiB pages buy).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
from pathlib import Path

if "torchhpc" not in sys.modules:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _plain(rows: int, row: int, huge: bool):
    """A (rows, row/4) float32 tensor over private anonymous memory advised for huge pages or against them."""
    import torch

    mm = mmap.mmap(-1, rows * row, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(mm, dtype=torch.float32).view(rows, row // 4)
    return t, mm


def _chunk(rows: int, row: int, directory: str | None):
    """A ChunkTensor of the same shape with its host tier in ``directory`` (default: /dev/shm)."""
    import torch

    from torchhpc.chunkstore import ChunkTensor

    if directory:
        os.environ["TORCHHPC_SHM_DIR"] = directory
    try:
        return ChunkTensor((rows, row // 4), torch.float32, capacity_per_device=0)
    finally:
        os.environ.pop("TORCHHPC_SHM_DIR", None)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--row-bytes", type=int, default=512)
    ap.add_argument("--gather", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--iters", type=int, default=5, help="gathers per round and way")
    ap.add_argument("--huge-dir", default=None, help="a tmpfs mounted huge=advise: adds chunk-2m")
    args = ap.parse_args(argv)

    import torch

    from torchhpc.bench.timing import interleaved, per_call_s, summary
    from torchhpc.runtime.hugepages import huge_kib

    rows, row = args.rows, args.row_bytes
    data = torch.randn(rows, row // 4)
    plain = {"plain-4k": _plain(rows, row, False), "plain-2m": _plain(rows, row, True)}
    for t, _ in plain.values():
        t.copy_(data)
    chunks = {"chunk-dev-shm": _chunk(rows, row, None)}
    if args.huge_dir:
        chunks["chunk-huge-dir"] = _chunk(rows, row, args.huge_dir)
    for ct in chunks.values():
        ct.load_from_tensor(data)
    pages = {name: "2m" if huge_kib(t.data_ptr(), t.nbytes) else "4k" for name, (t, _) in plain.items()}
    for name, ct in chunks.items():
        pages[name] = "2m" if ct._segments[0].huge_kib() else "4k"
    idx = torch.randint(0, rows, (args.gather,))
    out = torch.empty(args.gather, row // 4)
    ways = {name: (lambda t=t: torch.index_select(t, 0, idx, out=out)) for name, (t, _) in plain.items()}
    ways.update({name: (lambda ct=ct: ct.index(idx, out=out)) for name, ct in chunks.items()})
    for name, fn in ways.items():
        fn()
        assert torch.equal(out, data.index_select(0, idx)), name
    times = interleaved(ways, args.rounds, lambda fn: per_call_s(fn, args.iters))
    nbytes = args.gather * row
    print(f"# {args.gather} random rows of {row} B from {rows} rows ({rows * row >> 20} MiB), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; median [min-max] of {args.rounds} interleaved "
          f"rounds of {args.iters} gathers")
    print(f"{'way':>15} {'pages':>5} {'ms':>8} {'spread':>7} {'GB/s':>6}")
    med = {}
    for name, ts in times.items():
        m, lo, hi = summary(ts)
        med[name] = m
        print(f"{name:>15} {pages[name]:>5} {m * 1e3:8.2f} {(hi - lo) / m:6.1%} {nbytes / m / 1e9:6.2f}")
    for name in chunks:
        same = f"plain-{pages[name]}"
        print(f"{name} / {same} (same page size): {med[same] / med[name]:.3f}x the plain tensor's speed")
    print(f"2 MiB pages buy the plain tensor {med['plain-4k'] / med['plain-2m']:.3f}x")
    for ct in chunks.values():
        ct.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
