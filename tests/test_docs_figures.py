"""Figures quoted in the docs' prose agree with the JSON they were read from (docs/data/): each claim is found in
its page by a pattern and recomputed from the data, so a rerun that changes the data fails here until the prose
follows."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"

Times = dict[tuple[str, int, str], float]


def times(name: str) -> Times:
    """Median seconds per call by (collective, size, implementation) of one `torchhpc bench --json` file."""
    points = json.loads((DATA / name).read_text())["points"]
    return {(p["collective"], p["size"], p["impl"]): p["median_s"] for p in points}


def points(t: Times) -> list[tuple[str, int]]:
    return sorted({(c, s) for c, s, i in t if i == "accl"})


def gloo_range(name: str) -> tuple[float, float]:
    t = times(name)
    ratios = [t[c, s, "gloo"] / t[c, s, "accl"] for c, s in points(t)]
    return min(ratios), max(ratios)


def ahead_of_upstream(name: str) -> int:
    t = times(name)
    return sum(t[c, s, "mpi-upstream"] > t[c, s, "accl"] for c, s in points(t))


def small_excess(name: str) -> tuple[float, float]:
    """accl's time over raw MPI's (mpi4py on torch's memory), µs, at 8 B and 4 KiB."""
    t = times(name)
    extra = [(t[c, s, "accl"] - t[c, s, "mpi4py"]) * 1e6 for c, s in points(t) if s in (8, 4096)]
    return min(extra), max(extra)


def soak(name: str) -> list[dict]:
    """The trials of one `make fault-soak` record."""
    return json.loads((DATA / name).read_text())["trials"]


def soak_second_run() -> list[str]:
    """restart.md's sentence on the second soak: trials per fault, then the outcomes over all trials."""
    trials = soak("fault-soak-seed8.json")
    count = {f: sum(t["fault"] == f for t in trials) for f in ("kill-rank", "kill-node", "stop-node", "cut-link")}
    compared = [t for t in trials if t["bitwise_equal"] is not None]
    hangs = sum(t["ranks_gone_s"] is None for t in trials)  # the soak's record of a rank left past the deadline
    return [str(len(trials)), *map(str, count.values()), str(hangs),
            str(sum(t["finished"] for t in trials)), str(len(trials)), str(sum(t["bitwise_equal"] for t in compared)),
            str(len(compared)), str(sum(t["lost"] for t in trials)), one(max(t["ranks_gone_s"] or 0 for t in trials))]


def one(x: float) -> str:
    return f"{x:.1f}"


def whole(x: float) -> str:
    return f"{x:.0f}"


# (page, pattern whose groups are the figures, the figures as the data gives them, formatted as the prose writes)
CLAIMS: list[tuple[str, str, Callable[[], list[str]]]] = [
    ("accl.md", r"CPU tensors use `accl`: ([\d.]+)-([\d.]+)x faster than `gloo` at 2 ranks and ([\d.]+)-([\d.]+)x at 4",
     lambda: [one(gloo_range("accl-bench-2ranks.json")[0]), whole(gloo_range("accl-bench-2ranks.json")[1]),
              one(gloo_range("accl-bench-4ranks.json")[0]), whole(gloo_range("accl-bench-4ranks.json")[1])]),
    ("accl.md", r"Faster than gloo at every point on one node\*\* \(([\d.]+)x to ([\d.]+)x at 2 ranks, ([\d.]+)x to "
                r"([\d.]+)x at 4\)",
     lambda: [one(gloo_range("accl-bench-2ranks.json")[0]), whole(gloo_range("accl-bench-2ranks.json")[1]),
              one(gloo_range("accl-bench-4ranks.json")[0]), whole(gloo_range("accl-bench-4ranks.json")[1])]),
    ("accl.md", r"Faster than PyTorch's own MPI backend: at (\d+) of 50 points at 2 ranks and (\d+) of 50 at 4",
     lambda: [str(ahead_of_upstream("accl-bench-2ranks.json")), str(ahead_of_upstream("accl-bench-4ranks.json"))]),
    ("accl.md", r"Small calls cost raw \+ ([\d.]+)-([\d.]+) µs at 8 B and 4 KiB \(Open MPI, above: raw \+ "
                r"([\d.]+)-([\d.]+)\)",
     lambda: [*map(one, small_excess("accl-bench-2ranks-mpich.json")),
              *map(one, small_excess("accl-bench-2ranks.json"))]),
]


CLAIMS.append(
    ("restart.md", r"SOAK_SEED=8`, (\d+) trials in [\d.]+ min: (\d+) ranks killed, (\d+) nodes killed, (\d+) stopped, "
                   r"(\d+) links cut; \[its data\]\(data/fault-soak-seed8.json\)\): (\d+) hangs, "
                   r"(\d+) of (\d+) requeued and finished, (\d+) of (\d+) bitwise equal, (\d+) checkpoints lost, "
                   r"every rank gone within ([\d.]+) s",
     soak_second_run))


def recovery_rows() -> list[str]:
    """restart.md's in-place and requeue rows: trials, median, min and max seconds, completed and bitwise counts."""
    import statistics

    trials = json.loads((DATA / "recovery.json").read_text())["trials"]
    out = []
    for how in ("in-place", "requeue"):
        mine = [t for t in trials if t["how"] == how]
        secs = [t["recovery_s"] for t in mine]
        done = sum(t["state"] == "COMPLETED" for t in mine)
        out += [str(len(mine)), one(statistics.median(secs)), one(min(secs)), one(max(secs)), str(done),
                str(len(mine)), str(sum(t["bitwise"] for t in mine)), str(len(mine))]
    return out


CLAIMS.append(
    ("restart.md", r"\| in place, spare node \| (\d+) \| ([\d.]+) s \| ([\d.]+) - ([\d.]+) s \| (\d+) of (\d+) \| "
                   r"(\d+) of (\d+) \| \| Slurm requeue \| (\d+) \| ([\d.]+) s \| ([\d.]+) - ([\d.]+) s \| "
                   r"(\d+) of (\d+) \| (\d+) of (\d+) \|",
     recovery_rows))


def binding_figures() -> list[str]:
    """launcher.md's sentence on bench/binding.py: ranks, rounds, bound samples/s and spread, the two ratios."""
    import statistics

    data = json.loads((DATA / "binding.json").read_text())
    runs = data["samples_per_s"]
    med = {way: statistics.median(v) for way, v in runs.items()}
    spread = (max(runs["bound"]) - min(runs["bound"])) / med["bound"]
    return [str(data["ranks"]), str(len(runs["bound"])), whole(med["bound"]), f"{spread:.0%}",
            f"{med['self-bound'] / med['bound']:.2f}", f"{med['unbound'] / med['bound']:.2f}"]


CLAIMS.append(
    ("launcher.md", r"(\d+) ranks, (\d+) rounds \(\[its data\]\(data/binding.json\)\): bound (\d+) samples/s "
                    r"\(spread (\d+%)\), self-bound ([\d.]+)x, unbound ([\d.]+)x", binding_figures))


@pytest.mark.parametrize(("page", "pattern", "figures"), CLAIMS, ids=[f"{p}:{i}" for i, (p, *_) in enumerate(CLAIMS)])
def test_the_prose_quotes_its_data(page: str, pattern: str, figures: Callable[[], list[str]]) -> None:
    text = " ".join((ROOT / "docs" / page).read_text().split())  # one line: claims wrap anywhere
    found = re.search(pattern, text)
    assert found, f"{page}: the claim is gone or reworded; update CLAIMS: {pattern}"
    assert list(found.groups()) == figures(), f"{page}: {found.group(0)!r} but the data gives {figures()}"


def test_a_figure_off_from_its_data_is_caught() -> None:
    page, pattern, figures = CLAIMS[2]
    count = int(figures()[0]) + 1
    wrong = f"Faster than PyTorch's own MPI backend: at {count} of 50 points at 2 ranks and 1 of 50 at 4"
    found = re.search(pattern, wrong)
    assert found and list(found.groups()) != figures()


def test_the_virtual_clusters_all_reduce_table_is_its_data() -> None:
    """vcluster.md's all_reduce rows (accl, raw, gloo µs per call at each link and size) are the medians of
    docs/data/multinode-<rate>.json, as the bench prints them."""
    rates = {"unshaped": "none", "10 Gbit/s": "10gbit", "1 Gbit/s": "1gbit"}
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
    rows = re.findall(r"^\| (unshaped|10 Gbit/s|1 Gbit/s) \| (\d+) (B|KiB|MiB) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|",
                      (ROOT / "docs" / "vcluster.md").read_text(), re.M)
    assert len(rows) >= 10, rows
    for link, count, unit, *shown in rows:
        t = times(f"multinode-{rates[link]}.json")
        size = int(count) * units[unit]
        want = [t["allreduce", size, impl] * 1e6 for impl in ("accl", "mpi4py", "gloo")]
        assert shown == [f"{x:.1f}" if x < 100 else f"{x:.0f}" for x in want], (link, count, unit, shown, want)


def test_the_spare_node_soak_table_is_its_data() -> None:
    """restart.md's spare-node soak table is the soak's own table of the trials recorded beside it."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "vcluster"))
    sys.path.insert(0, str(ROOT / "tests"))
    from soak import spare_table

    data = json.loads((DATA / "fault-soak-spare.json").read_text())
    assert spare_table(data["trials"]) == data["table"]
    assert data["table"] in (ROOT / "docs" / "restart.md").read_text()


def test_the_side_by_side_figures_are_their_data() -> None:
    """accl.md's comparison with the tree before the speed work: the counts, the median ratio, the ratios around
    the carried limit, the points above the earlier tree's range and their rerun, from the two JSON files."""
    import statistics

    rows = json.loads((DATA / "accl-side-by-side.json").read_text())["summary"]
    rerun = {(r["collective"], r["size"]): r for r in
             json.loads((DATA / "accl-side-by-side-rerun.json").read_text())["summary"]}
    at = {(r["collective"], r["size"]): r["ratio"] for r in rows}
    text = " ".join((ROOT / "docs" / "accl.md").read_text().split())
    assert (f"lower now at {sum(r['ratio'] < 1 for r in rows)} of {len(rows)} points, median ratio now/then "
            f"{statistics.median(r['ratio'] for r in rows):.2f}") in text
    r = {k: f"{v:.2f}x" for k, v in at.items()}
    assert (f"all_reduce 16 KiB {r['all_reduce', 16384]}, 64 KiB {r['all_reduce', 65536]}, 128 KiB "
            f"{r['all_reduce', 131072]}; broadcast 16 KiB {r['broadcast', 16384]}, 64 KiB {r['broadcast', 65536]}, "
            f"128 KiB {r['broadcast', 131072]}") in text
    above = [x for x in rows if x["new_us"] > x["old_range_us"][1]]
    assert [(x["collective"], x["size"]) for x in above] == [("broadcast", 4 << 20), ("all_gather", 64)]
    assert (f"broadcast at 4 MiB ({at['broadcast', 4 << 20]:.2f}x) and all_gather at 64 B "
            f"({at['all_gather', 64]:.2f}x)") in text
    again = [rerun[x["collective"], x["size"]] for x in above]
    assert f"): {again[0]['ratio']:.2f}x and {again[1]['ratio']:.2f}x, each inside the earlier tree's range" in text
    assert all(a["old_range_us"][0] <= a["new_us"] <= a["old_range_us"][1] for a in again)
