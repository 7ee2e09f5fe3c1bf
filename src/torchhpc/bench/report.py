"""The nccl-tests-style tables of ``torchhpc bench``: per implementation the median time, the rounds' spread and
busbw; then accl's ratios to raw MPI on the same memory and to the other backends, and the targets it misses."""

from __future__ import annotations

from .results import LABELS, RAW, Point, bus_factor

__all__ = ["SMALL_BELOW", "TARGET_EXTRA_US", "TARGET_BW_RATIO", "legend", "print_table", "targets", "human"]

SMALL_BELOW = 1 << 20  # below: the "+3 us over raw" target (torch's per-call cost included); from here: 0.95x busbw
TARGET_EXTRA_US = 3.0
TARGET_BW_RATIO = 0.95
GROUP_W = 24  # the width of one implementation's column group (time, spread, busbw)


def human(nbytes: int) -> str:
    """``4 KiB`` for 4096."""
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes / div:g} {unit}"
    return f"{nbytes} B"


def _bw(gbs: float) -> str:
    """A bandwidth in at most 7 characters, 3 significant digits."""
    return f"{gbs:.0f}" if gbs >= 1000 else f"{gbs:.3g}" if gbs >= 0.001 else f"{gbs:.1e}"


def legend(repeats: int) -> str:
    """What the columns of :func:`print_table` mean (printed once, above the tables)."""
    return "\n".join([
        f"# time: us per call, the median of {repeats} interleaved round(s), a round being the slowest rank's "
        "mean over its calls;",
        "# spread: (max - min) / median of those round means; busbw: GB/s, algbw (size / time) x the nccl-tests "
        "factor;",
        f"# raw = {LABELS[RAW]}, the plain MPI call on the tensors' own memory. accl-raw: accl's time - raw's (us); "
        "bw x: accl busbw / raw busbw,",
        "#   rounds: that ratio round by round (min-max); upstream/accl, gloo/accl: their time / accl's (> 1: accl "
        "faster);",
        f"# targets a row misses: +us (below 1 MiB, accl > raw + {TARGET_EXTRA_US:g} us), bw (from 1 MiB, bw x < "
        f"{TARGET_BW_RATIO}), up (mpi-upstream not slower than accl).",
    ])


def targets(size: int, t: dict[str, float]) -> str:
    """The targets a row misses (``ok`` when none): ``+us`` (below 1 MiB, accl more than 3 us over raw),
    ``bw`` (from 1 MiB, accl's busbw under 0.95x raw's), ``up`` (mpi-upstream as fast or faster)."""
    if "accl" not in t:
        return "-"
    miss = []
    if RAW in t and size < SMALL_BELOW and (t["accl"] - t[RAW]) * 1e6 > TARGET_EXTRA_US:
        miss.append("+us")
    if RAW in t and size >= SMALL_BELOW and t[RAW] / t["accl"] < TARGET_BW_RATIO:
        miss.append("bw")
    if "mpi-upstream" in t and t["mpi-upstream"] <= t["accl"]:
        miss.append("up")
    return ",".join(miss) or "ok"


def _ratio_columns(have: set[str]) -> tuple[bool, list[str]]:
    """Which of accl's ratio columns a table has: accl vs raw MPI (both timed), and the other backends
    (``mpi-upstream``, ``gloo``) timed beside accl."""
    raw_ratio = {"accl", RAW} <= have
    others = [i for i in ("mpi-upstream", "gloo") if i in have and "accl" in have]
    return raw_ratio, others


def _ratio_head(raw_ratio: bool, others: list[str]) -> str:
    """The second header line's ratio part: accl - raw, bw x and its rounds, one column per other backend,
    the targets ("" with no ratio column)."""
    if not (raw_ratio or others):
        return ""
    head = f" {'accl-raw':>8} {'bw x':>5} {'rounds':>9}" if raw_ratio else ""
    for i in others:
        head += f" {('upstream' if i == 'mpi-upstream' else i) + '/accl':>13}"
    return head + f" {'targets':>8}"


def _print_head(impls: list[str], raw_ratio: bool, others: list[str]) -> None:
    """Print the two header lines: the implementations' names over their column groups, then the columns."""
    head1 = f"#{'':>9}" + "".join(f" | {LABELS[impl]:^{GROUP_W}}" for impl in impls)
    head2 = f"#{'size':>9}" + "".join(f" | {'time':>9} {'spread':>6} {'busbw':>7}" for _ in impls)
    ratios2 = _ratio_head(raw_ratio, others)
    if ratios2:
        head1 += f" | {'accl vs the others':^{len(ratios2) - 1}}"
        head2 += " |" + ratios2
    print(head1.rstrip())
    print(head2.rstrip())


def _impl_cells(pts: dict[str, Point], impls: list[str]) -> str:
    """One row's column groups: per implementation its median time (us), spread and busbw, ``-`` if untimed."""
    cells = ""
    for impl in impls:
        if impl not in pts:
            cells += f" | {'-':>{GROUP_W}}"
            continue
        p = pts[impl]
        cells += f" | {p.median_s * 1e6:9.1f} {p.spread * 100:5.1f}% {_bw(p.busbw()):>7}"
    return cells


def _ratio_cells(size: int, pts: dict[str, Point], t: dict[str, float], raw_ratio: bool,
                 others: list[str]) -> str:
    """One row's ratio part: accl - raw (us), raw/accl time with its per-round range, the other backends'
    time / accl's, and the targets missed ("" with no ratio column)."""
    if not (raw_ratio or others):
        return ""
    cells = " |"
    if raw_ratio:
        paired = [m / a for a, m in zip(pts["accl"].rounds_s, pts[RAW].rounds_s, strict=False)]
        cells += (f" {(t['accl'] - t[RAW]) * 1e6:8.1f} {t[RAW] / t['accl']:5.2f} "
                  f"{min(paired):4.2f}-{max(paired):4.2f}")
    for i in others:
        cells += f" {t[i] / t['accl']:12.2f}x"
    return cells + f" {targets(size, t):>8}"


MISSED_WORDS = {"+us": f"more than {TARGET_EXTRA_US:g} us over raw MPI",
                "bw": f"under {TARGET_BW_RATIO:g}x raw MPI's bandwidth",
                "up": "not faster than PyTorch's own MPI backend"}


def _print_targets_summary(by_size: dict[int, dict[str, Point]], have: set[str]) -> None:
    """The verdict in words: at how many sizes accl met its targets, and at which it missed which."""
    if not ("accl" in have and (RAW in have or "mpi-upstream" in have)):
        return
    missed = [f"{human(s)} ({'; '.join(MISSED_WORDS[c] for c in m.split(','))})" for s in sorted(by_size)
              if (m := targets(s, {i: by_size[s][i].median_s for i in by_size[s]})) not in ("ok", "-")]
    met = len(by_size) - len(missed)
    print(f"# verdict: accl met its targets at {met} of {len(by_size)} sizes"
          + (f"; missed at {', '.join(missed)}" if missed else ""))


def print_table(rows: list[Point], impls: list[str], repeats: int) -> None:
    """Print one collective's table at one rank count (nccl-tests style): per implementation the median time,
    the rounds' spread and busbw; then accl's ratios to raw MPI and to the other backends."""
    coll, n = rows[0].collective, rows[0].ranks
    impls = [i for i in impls if any(p.impl == i for p in rows)]
    by_size: dict[int, dict[str, Point]] = {}
    for p in rows:
        by_size.setdefault(p.size, {})[p.impl] = p
    have = set(impls)
    raw_ratio, others = _ratio_columns(have)
    print(f"\n# {coll}, float32, {n} ranks, median of {repeats} round(s), busbw factor {bus_factor(coll, n):.3g}")
    _print_head(impls, raw_ratio, others)
    for size in sorted(by_size):
        pts = by_size[size]
        t = {i: pts[i].median_s for i in impls if i in pts}
        line = f"{human(size):>10}" + _impl_cells(pts, impls) + _ratio_cells(size, pts, t, raw_ratio, others)
        print(line.rstrip(), flush=True)
    _print_targets_summary(by_size, have)
