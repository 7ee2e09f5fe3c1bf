"""``torchhpc bench`` (torchhpc.bench): a quick two-rank run of every default implementation and collective with
its JSON and plot, the tables printed and drawn again from the JSON, the ratio and target columns on made-up
times, the plot's panels, the timing rounds, the launch environment and argument checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from torchhpc.bench import cli, plot, report, results, runners, timing
from torchhpc.launcher import MPI_LAUNCHER_VARS

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for var in MPI_LAUNCHER_VARS:
        env.pop(var, None)
    return env


def test_quick_run_measures_every_impl_and_collective(tmp_path: Path) -> None:
    """``torchhpc bench all --np 2 --quick --json --plot x.png``: every default implementation (mpi-upstream where
    `make mpi-backend` built it, else skipped with its reason) on every collective and size, positive times,
    a table per collective, a PNG; ``--from-json`` prints the same rows again without MPI and draws an SVG."""
    out, png, svg = tmp_path / "bench.json", tmp_path / "busbw.png", tmp_path / "busbw.svg"
    res = subprocess.run(
        [sys.executable, "-m", "torchhpc", "bench", "all", "--np", "2", "--quick", "--time-per-point", "0.02",
         "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=150, env=_env(), check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    meta, points = data["meta"], data["points"]
    assert meta["ranks"] == 2 and set(meta["impls"]) | set(meta["skipped"]) == set(results.DEFAULT_IMPLS)
    if any((ROOT / "src" / "torchhpc" / "mpi_upstream").glob("_pg_mpi_openmpi*.so")):
        assert "mpi-upstream" in meta["impls"], meta["skipped"]
    else:
        assert "not timing mpi-upstream, PyTorch's own MPI backend: it is not built" in res.stdout
    got = sorted((p["collective"], p["size"], p["impl"]) for p in points)
    assert got == sorted((c, s, i) for c in results.COLLECTIVES for s in cli.QUICK_SIZES for i in meta["impls"])
    assert all(p["ranks"] == 2 and len(p["rounds_s"]) == 1 and p["median_s"] > 0 and p["busbw_GBps"] > 0
               for p in points)
    assert {p["label"] for p in points if p["impl"] == "mpi4py"} == {"mpi(torch mem)"}
    for coll in results.COLLECTIVES:
        assert f"# {coll}, float32, 2 ranks" in res.stdout
    rows = [ln for ln in res.stdout.splitlines() if ln.strip().startswith(("8 B", "4 KiB", "1 MiB"))]
    assert len(rows) == 15 and all(ln.count("|") == len(meta["impls"]) + 1 for ln in rows), res.stdout
    assert png.read_bytes().startswith(PNG_MAGIC)
    again = subprocess.run([sys.executable, "-m", "torchhpc", "bench", "--from-json", str(out), "--plot", str(svg)],
                           capture_output=True, text=True, timeout=60, env=_env(), check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [ln for ln in again.stdout.splitlines() if ln in rows] == rows
    ElementTree.fromstring(svg.read_text())  # a well-formed SVG


def test_table_ratios_and_targets(capsys) -> None:
    """The ratio columns (accl - raw, bw x with its rounds, upstream/accl, gloo/accl) and the targets."""
    us = 1e-6
    times = {"accl": (3.0, 1000.0), "mpi-upstream": (9.0, 900.0), "gloo": (60.0, 5000.0), "mpi4py": (2.0, 1000.0)}
    rows = [results.Point("allreduce", 2, size, impl, [t[k] * us] * 3)
            for k, size in enumerate((8, 1 << 20)) for impl, t in times.items()]
    report.print_table(rows, list(times), 3)
    out = capsys.readouterr().out
    small = next(ln for ln in out.splitlines() if ln.strip().startswith("8 B"))
    big = next(ln for ln in out.splitlines() if ln.strip().startswith("1 MiB"))
    assert small.split("|")[-1].split() == ["1.0", "0.67", "0.67-0.67", "3.00x", "20.00x", "ok"]
    assert big.split("|")[-1].split() == ["0.0", "1.00", "1.00-1.00", "0.90x", "5.00x", "up"]
    assert "# verdict: accl met its targets at 1 of 2 sizes; missed at 1 MiB (not faster than PyTorch's own MPI " \
           "backend)" in out
    assert report.targets(8, {"accl": 5.1 * us, "mpi4py": 2 * us}) == "+us"  # 3.1 us over raw
    assert report.targets(8, {"accl": 4.9 * us, "mpi4py": 2 * us}) == "ok"
    assert report.targets(1 << 20, {"accl": 1.1, "mpi4py": 1.0}) == "bw"


def test_plot_has_a_panel_per_collective_and_rank_count(tmp_path: Path) -> None:
    points = [results.Point(c, n, s, i, [1e-6 + s / 1e9 * (2 if i == "gloo" else 1)])
              for n in (2, 4) for c in ("allreduce", "alltoall") for s in (8, 4096, 1 << 20) for i in ("accl", "gloo")]
    fig = plot.figure(points, ["accl", "gloo", "mpi4py"])
    assert [ax.get_title() for ax in fig.axes] == ["allreduce, 2 ranks", "alltoall, 2 ranks", "allreduce, 4 ranks",
                                                  "alltoall, 4 ranks"]
    assert all(len(ax.get_lines()) == 2 for ax in fig.axes)  # mpi4py has no points: no line, no legend entry
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["accl", "gloo"]
    line = fig.axes[0].get_lines()[0]
    assert list(line.get_xdata()) == [8, 4096, 1 << 20] and line.get_ydata()[0] == pytest.approx(
        points[0].busbw())
    for name in ("p.png", "p.svg"):
        plot.write_plot(str(tmp_path / name), points, ["accl", "gloo"])
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_MAGIC)
    assert "allreduce, 4 ranks" in (tmp_path / "p.svg").read_text()


def test_plot_without_matplotlib_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(plot.PlotUnavailableError, match=r"pip install 'torchhpc\[plot\]'"):
        plot.figure([results.Point("allreduce", 2, 8, "accl", [1e-6])], ["accl"])


def test_bad_arguments_are_refused(capsys) -> None:
    assert cli.main(["--plot", "busbw.jpg"]) == 2
    assert cli.main(["--impls", "accl,nccl"]) == 2
    assert cli.main(["allreduce", "--np", "0"]) == 2
    assert cli.main(["allreduce", "--repeats", "0"]) == 2
    assert "--plot writes .png, .svg, .pdf" in capsys.readouterr().err
    assert cli.main(["allreduce", "--json", "/nonexistent-dir/bench.json"]) == 2
    assert "--json /nonexistent-dir/bench.json: directory /nonexistent-dir does not exist" in capsys.readouterr().err


def test_sizes_are_the_bytes_really_moved() -> None:
    assert runners.measured_bytes("allreduce", 8, 4) == 8
    assert runners.measured_bytes("allgather", 8, 4) == 16  # one float32 per rank at least
    assert runners.measured_bytes("alltoall", 1 << 20, 3) == (1 << 20) // 12 * 12
    assert all(runners.measured_bytes(c, s, 2) == s for c in results.COLLECTIVES for s in cli.FULL_SIZES)


def test_bus_factors() -> None:
    assert results.bus_factor("allreduce", 2) == 1.0
    assert results.bus_factor("allreduce", 4) == 1.5
    assert results.bus_factor("allgather", 4) == 0.75
    assert results.bus_factor("broadcast", 8) == 1.0


def test_rounds_rotate_so_that_no_entry_is_always_first() -> None:
    order: list[str] = []
    fns = {k: (lambda k=k: order.append(k)) for k in "abc"}
    got = timing.interleaved(fns, 4, lambda fn: (fn(), float(len(order)))[1])
    assert order == list("abc" "bca" "cab" "abc")
    assert got == {"a": [1.0, 6.0, 8.0, 10.0], "b": [2.0, 4.0, 9.0, 11.0], "c": [3.0, 5.0, 7.0, 12.0]}
    assert timing.summary([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)


def test_bench_launch_yields_only_when_oversubscribed(monkeypatch) -> None:
    """Open MPI's yield-when-idle slows large blocking calls; the benchmark sets it only for more ranks than cores."""
    seen: list[dict] = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, env: seen.append((cmd, env)) or 0)
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    from torchhpc.runtime.mpirun import available_cores

    cli._relaunch(["allreduce"], 1)
    cli._relaunch(["allreduce"], available_cores() + 1)
    assert "OMPI_MCA_mpi_yield_when_idle" not in seen[0][1]
    assert seen[1][1]["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert seen[0][0][-3:] == ["-m", "torchhpc.bench", "allreduce"]


@pytest.mark.full("the docs' plots drawn again from their data (matplotlib)")
def test_the_docs_busbw_plots_are_drawn_from_their_data(tmp_path: Path) -> None:
    """`make docs-plots` draws each docs/img/*-busbw*.svg from docs/data: the same data gives the same file, each
    titled with what the run was (one node, or the virtual cluster's nodes and link)."""
    pytest.importorskip("matplotlib")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["make", "-s", "docs-plots", f"PLOTS_DIR={tmp_path}", f"VENV={Path(sys.prefix)}"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    drawn = sorted(p.name for p in tmp_path.glob("*.svg"))
    assert drawn == sorted(p.name for p in (root / "docs/img").glob("*busbw*.svg")), drawn
    for name in drawn:
        assert (tmp_path / name).read_bytes() == (root / "docs/img" / name).read_bytes(), "run `make docs-plots`"
    assert "link: TCP shaped to 1 Gbit/s" in (tmp_path / "multinode-busbw-1gbit-4nodes.svg").read_text()
    assert ">4 nodes of the virtual cluster" in (tmp_path / "multinode-busbw-1gbit-4nodes.svg").read_text()


def test_the_legend_draws_every_implementation_as_its_lines() -> None:
    pytest.importorskip("matplotlib")
    points = [results.Point("allreduce", 2, s, i, [1e-6]) for s in (8, 64) for i in ("accl", "mpi4py")]
    fig = plot.figure(points, ["accl", "mpi4py"], "a title")
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["accl", "mpi(torch mem)"]
    assert [h.get_linestyle() for h in legend.legend_handles] == ["-", "--"], "each entry a line, not a dot"
    assert fig.get_suptitle() == "a title"


@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_per_call_costs_are_drawn_as_bars(tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / f"cost{suffix}"
    costs = {"all_reduce_8B": {"accl": (9.0, 8.5, 11.0), "mpi4py": (0.6, 0.5, 0.7), "torch floor": (4.0, 3.9, 4.2),
                               "gloo": (30.0, 28.0, 33.0)},
             "broadcast_1MiB": {"accl": (95.0, 90.0, 99.0), "mpi4py": (80.0, 79.0, 82.0),
                                "gloo": (400.0, 390.0, 420.0)}}
    plot.write_cost_plot(str(out), costs, "per-call cost")
    if suffix == ".png":
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        return
    text = "".join(ElementTree.parse(out).getroot().itertext())
    for word in ("all_reduce_8B", "broadcast_1MiB", "accl", "torch floor", "gloo", "µs per call"):
        assert word in text, word


def test_training_step_quick_run_prints_both_steps() -> None:
    """``bench/training_step.py --quick`` under mpiexec: a table per model with the floor, accl and gloo, each
    step time positive and the overhead column filled for the backends."""
    from _mpijob import run_mpi

    res = run_mpi(2, [sys.executable, str(ROOT / "bench" / "training_step.py"), "--quick", "--impls",
                      "floor,accl,gloo"], timeout=300)
    assert res.returncode == 0, res.stdout[-3000:]
    for model in ("## DDP, ResNet-18 layout", "## FSDP2, transformer"):
        block = res.stdout.split(model, 1)[1].split("##", 1)[0]
        rows = {ln.split("|")[1].strip(): ln.split("|")[2:-1] for ln in block.splitlines()
                if ln.startswith("| ") and not ln.startswith(("| implementation", "| ---"))}
        assert set(rows) == {"floor", "accl", "gloo"}, block
        assert all(float(cells[0]) > 0 for cells in rows.values())
        assert rows["floor"][2].strip() == "" and rows["accl"][2].strip() and rows["gloo"][3].strip().endswith("x")


def test_overlap_quick_run_prints_every_impl_against_the_floor() -> None:
    """``bench/accl_overlap.py --quick`` under mpiexec: the floor and each backend's ms per iteration, the
    backends' overhead over the floor; an unknown implementation is refused by name."""
    from _mpijob import run_mpi

    script = str(ROOT / "bench" / "accl_overlap.py")
    res = run_mpi(2, [sys.executable, script, "--quick", "--impls", "floor,accl,gloo"], timeout=300)
    assert res.returncode == 0, res.stdout[-3000:]
    rows = {ln.split()[0]: ln.split() for ln in res.stdout.splitlines() if ln.split()[:1] in (["floor"], ["accl"],
                                                                                           ["gloo"])}
    assert set(rows) == {"floor", "accl", "gloo"}, res.stdout[-3000:]
    assert all(float(r[1]) > 0 for r in rows.values())
    assert "over the floor" not in " ".join(rows["floor"]) and "over the floor" in " ".join(rows["accl"])
    bad = subprocess.run([sys.executable, script, "--impls", "accl,nccl"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert bad.returncode == 2 and "unknown implementations ['nccl']" in bad.stderr, bad.stderr
