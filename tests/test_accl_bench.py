"""``torchhpc bench`` (torchhpc.accl.bench): a quick two-rank run of every default implementation and collective
with its JSON and SVG, the tables printed again from the JSON, and the ratio and target columns on made-up
times.  (tests/test_accl.py has the bus factors and the launch environment.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

from torchhpc.accl import bench
from torchhpc.launcher import MPI_LAUNCHER_VARS

ROOT = Path(__file__).resolve().parents[1]
SVG = "{http://www.w3.org/2000/svg}"


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for var in MPI_LAUNCHER_VARS:
        env.pop(var, None)
    return env


def test_quick_run_measures_every_impl_and_collective(tmp_path: Path) -> None:
    """``torchhpc bench all --np 2 --quick --json --plot``: every default implementation (mpi-upstream where
    `make mpi-backend` built it, else skipped with its reason) on every collective and size, positive times,
    a table per collective, one SVG line per collective and implementation; ``--from-json`` prints the same
    rows again without MPI."""
    out, svg = tmp_path / "bench.json", tmp_path / "busbw.svg"
    res = subprocess.run(
        [sys.executable, "-m", "torchhpc", "bench", "all", "--np", "2", "--quick", "--time-per-point", "0.02",
         "--json", str(out), "--plot", str(svg)],
        capture_output=True, text=True, timeout=150, env=_env(), check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    meta, points = data["meta"], data["points"]
    assert meta["ranks"] == 2 and set(meta["impls"]) | set(meta["skipped"]) == set(bench.DEFAULT_IMPLS)
    if any((ROOT / "src" / "torchhpc" / "mpi_upstream").glob("_pg_mpi_openmpi*.so")):
        assert "mpi-upstream" in meta["impls"], meta["skipped"]
    else:
        assert "skipping mpi-upstream" in res.stdout
    got = sorted((p["collective"], p["size"], p["impl"]) for p in points)
    assert got == sorted((c, s, i) for c in bench.COLLECTIVES for s in bench.QUICK_SIZES for i in meta["impls"])
    assert all(p["ranks"] == 2 and len(p["rounds_s"]) == 1 and p["median_s"] > 0 and p["busbw_GBps"] > 0
               for p in points)
    assert {p["label"] for p in points if p["impl"] == "mpi4py"} == {"mpi(torch mem)"}
    for coll in bench.COLLECTIVES:
        assert f"# {coll}, float32, 2 ranks" in res.stdout
    rows = [ln for ln in res.stdout.splitlines() if ln.strip().startswith(("8 B", "4 KiB", "1 MiB"))]
    assert len(rows) == 15 and all(ln.count("|") == len(meta["impls"]) + 1 for ln in rows), res.stdout
    assert len(ElementTree.fromstring(svg.read_text()).findall(f"{SVG}polyline")) == 5 * len(meta["impls"])
    again = subprocess.run([sys.executable, "-m", "torchhpc", "bench", "--from-json", str(out)],
                           capture_output=True, text=True, timeout=60, env=_env(), check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [ln for ln in again.stdout.splitlines() if ln in rows] == rows


def test_table_ratios_and_targets(capsys) -> None:
    """The ratio columns (accl - raw, bw x with its rounds, upstream/accl, gloo/accl) and the targets."""
    us = 1e-6
    times = {"accl": (3.0, 1000.0), "mpi-upstream": (9.0, 900.0), "gloo": (60.0, 5000.0), "mpi4py": (2.0, 1000.0)}
    rows = [bench.Point("allreduce", 2, size, impl, [t[k] * us] * 3)
            for k, size in enumerate((8, 1 << 20)) for impl, t in times.items()]
    bench.print_table(rows, list(times), 3)
    out = capsys.readouterr().out
    small = next(ln for ln in out.splitlines() if ln.strip().startswith("8 B"))
    big = next(ln for ln in out.splitlines() if ln.strip().startswith("1 MiB"))
    assert small.split("|")[-1].split() == ["1.0", "0.67", "0.67-0.67", "3.00x", "20.00x", "ok"]
    assert big.split("|")[-1].split() == ["0.0", "1.00", "1.00-1.00", "0.90x", "5.00x", "up"]
    assert "# targets met at 1 of 2 sizes; missed: 1 MiB (up)" in out
    assert bench._targets(8, {"accl": 5 * us, "mpi4py": 2 * us}) == "+us"
    assert bench._targets(1 << 20, {"accl": 1.1, "mpi4py": 1.0}) == "bw"


def test_svg_has_a_panel_per_collective_and_rank_count(tmp_path: Path) -> None:
    points = [bench.Point(c, n, s, i, [1e-6 + s / 1e9 * (2 if i == "gloo" else 1)])
              for n in (2, 4) for c in ("allreduce", "alltoall") for s in (8, 4096, 1 << 20) for i in ("accl", "gloo")]
    path = tmp_path / "p.svg"
    bench.write_svg(str(path), points, ["accl", "gloo", "mpi4py"])
    root = ElementTree.fromstring(path.read_text())
    titles = [t.text for t in root.iter(f"{SVG}text") if t.text and "ranks" in t.text]
    assert titles == ["allreduce, 2 ranks", "alltoall, 2 ranks", "allreduce, 4 ranks", "alltoall, 4 ranks"]
    assert len(root.findall(f"{SVG}polyline")) == 8  # mpi4py has no points: no line, no legend entry
    assert "mpi(torch mem)" not in path.read_text()


def test_bad_arguments_are_refused() -> None:
    assert bench.main(["--plot", "busbw.png"]) == 2
    assert bench.main(["--impls", "accl,nccl"]) == 2


def test_sizes_are_the_bytes_really_moved() -> None:
    assert bench.measured_bytes("allreduce", 8, 4) == 8
    assert bench.measured_bytes("allgather", 8, 4) == 16  # one float32 per rank at least
    assert bench.measured_bytes("alltoall", 1 << 20, 3) == (1 << 20) // 12 * 12
    assert all(bench.measured_bytes(c, s, 2) == s for c in bench.COLLECTIVES for s in bench.FULL_SIZES)
