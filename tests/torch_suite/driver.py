"""Run PyTorch's own distributed test suite (``DistributedTest._DistTestBase``) on accl and on gloo.

Every test runs in an mpiexec world of ``--np`` ranks (plain ``mpiexec -n N``, oversubscribed when the
machine has fewer cores), one test after another in the same job (``rank_worker.py``).  A test that
fails ends the job and the next test starts in a fresh one; a test that runs past its limit has the job
killed, is recorded as ``timeout``, and the suite goes on.  Both backends run through this same harness.

    python tests/torch_suite/driver.py --out torch-suite-results [--np 3] [--backends accl,gloo]
        [--tests name,name,...] [--per-test-timeout 120] [--mpich]

``--backends mpi_upstream`` runs PyTorch's own MPI backend built by ``make mpi-backend`` as torch's ``"mpi"``
(``BACKEND=mpi``, as PyTorch's CI runs the suite for it); ``--mpich`` launches with the MPICH that ``make env``
puts beside the Open MPI venv instead of the venv's mpiexec.

writes ``<out>/<backend>.jsonl`` (one line per test), ``<out>/summary.json`` and prints the counts, the
tests that pass on gloo but not on accl, and those skipped on accl but run on gloo; the latter (torch marks
them gloo-only) are then run on accl once more with the skip markers ignored, and their outcomes listed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def all_test_names() -> list[str]:
    """Every test of torch's ``DistributedTest._DistTestBase``, in unittest's (sorted) order."""
    code = ("import os, unittest; os.environ.setdefault('BACKEND', 'gloo'); os.environ.setdefault('WORLD_SIZE', '3');"
            "os.environ.setdefault('TEMP_DIR', '/tmp');"
            "from torch.testing._internal.distributed.distributed_test import DistributedTest as D;"
            "print('\\n'.join(unittest.TestLoader().getTestCaseNames(D._DistTestBase)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def _job_env(mpich: bool = False) -> tuple[dict[str, str], str | None]:
    """The jobs' environment and mpiexec (None: the venv's); ``mpich``: the side MPICH's."""
    sys.path.insert(0, str(ROOT / "src"))
    from torchhpc.runtime.mpirun import local_job_env, side_mpich, side_mpich_env

    env = local_job_env()
    mpiexec = None
    if mpich:
        root = side_mpich()
        if root is None:
            raise RuntimeError("--mpich: no MPICH beside this venv (`make env` puts the mpich wheel in $VENV/mpich)")
        env, mpiexec = side_mpich_env(root, env), str(root / "bin" / "mpiexec")
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env, mpiexec


def run_backend(backend: str, names: list[str], out: Path, np: int, per_test_timeout: float,
                declare_features: bool = True, log=print, ignore_skip_markers: bool = False,
                tag: str = "", mpich: bool = False) -> list[dict]:
    """Run ``names`` on ``backend``; return one record per test (outcome pass/fail/skip/timeout).
    ``ignore_skip_markers``: run tests whose unittest skip marker says not to (for gloo-only tests);
    ``mpich``: launch with the side MPICH (see :func:`_job_env`)."""
    from torchhpc.runtime.mpirun import mpiexec_argv

    stem = backend + tag
    tests_file = out / f"{stem}.tests"
    tests_file.write_text("\n".join(names) + "\n")
    results = out / f"{stem}.jsonl"
    results.unlink(missing_ok=True)
    progress = out / f"{stem}.progress"
    log_file = out / f"{stem}.log"
    env, mpiexec = _job_env(mpich)
    start = 0
    with open(log_file, "w") as logf:
        while start < len(names):
            progress.unlink(missing_ok=True)
            argv = [sys.executable, str(HERE / "rank_worker.py"), "--backend", backend, "--tests", str(tests_file),
                    "--start", str(start), "--results", str(results), "--progress", str(progress)]
            if declare_features:
                argv.append("--declare-features")
            if ignore_skip_markers:
                argv.append("--ignore-skip-markers")
            proc = subprocess.Popen(mpiexec_argv(np, argv, mpiexec=mpiexec), stdout=logf, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
            launched = time.time()
            timed_out = None
            while proc.poll() is None:
                time.sleep(0.5)
                try:
                    state = json.loads(progress.read_text())
                except (OSError, ValueError):
                    state = None
                if state is None:
                    if time.time() - launched > per_test_timeout:
                        timed_out = {"index": start, "test": names[start]}
                elif state["test"] is not None and time.time() - state["start"] > per_test_timeout:
                    timed_out = state
                if timed_out:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
            done = _read(results)
            if timed_out is not None:
                with open(results, "a") as f:
                    f.write(json.dumps({"index": timed_out["index"], "test": timed_out["test"],
                                        "outcome": "timeout", "seconds": per_test_timeout,
                                        "detail": f"no result within {per_test_timeout:.0f} s; job killed"}) + "\n")
                start = timed_out["index"] + 1
            elif done and done[-1]["index"] >= start:
                start = done[-1]["index"] + 1
            elif not progress.exists():  # the job never reached its first test: nothing else will either
                logf.flush()
                tail = log_file.read_text()[-3000:]
                raise RuntimeError(f"{backend}: the suite's job failed to start (exit {proc.returncode}):\n{tail}")
            else:  # the job ended without recording the test it was in (a crash inside the test)
                with open(results, "a") as f:
                    f.write(json.dumps({"index": start, "test": names[start], "outcome": "fail",
                                        "seconds": 0, "detail": f"job exited {proc.returncode} without a "
                                        f"result; see {log_file.name}"}) + "\n")
                start += 1
            log(f"[{backend}] {start}/{len(names)} done")
    return _read(results)


def _last_line(detail: str) -> str:
    lines = [x for x in detail.splitlines()
             if x.strip() and not x.startswith(" ") and "To execute" not in x and "suppressed" not in x]
    return lines[-1][:300] if lines else ""


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def counts(records: list[dict]) -> dict[str, int]:
    """pass/fail/skip/timeout counts."""
    c = {"pass": 0, "fail": 0, "skip": 0, "timeout": 0}
    for r in records:
        c[r["outcome"]] += 1
    return c


def compare(accl: list[dict], gloo: list[dict]) -> dict[str, list[dict]]:
    """Tests where accl falls short of gloo: failing (or timing out) on accl while passing on gloo, and
    skipped on accl while gloo ran them (skipped only because the backend is not gloo)."""
    g = {r["test"]: r for r in gloo}
    worse = {"fail_on_accl_pass_on_gloo": [], "skip_on_accl_run_on_gloo": []}
    for r in accl:
        other = g.get(r["test"])
        if other is None or other["outcome"] != "pass":
            continue
        if r["outcome"] in ("fail", "timeout"):
            worse["fail_on_accl_pass_on_gloo"].append(r)
        elif r["outcome"] == "skip":
            worse["skip_on_accl_run_on_gloo"].append(r)
    return worse


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("torch-suite-results"))
    parser.add_argument("--np", type=int, default=3, help="ranks (PyTorch runs this suite at 3)")
    parser.add_argument("--backends", default="accl,gloo")
    parser.add_argument("--tests", default="", help="comma-separated test names (default: all)")
    parser.add_argument("--per-test-timeout", type=float, default=150.0)
    parser.add_argument("--mpich", action="store_true", help="launch with the MPICH beside the venv")
    parser.add_argument("--no-declare-features", action="store_true",
                        help="do not enter accl in torch's DistTestCases.backend_feature sets")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.tests.split(",") if n] or all_test_names()
    results = {}
    t0 = time.time()
    for backend in args.backends.split(","):
        results[backend] = run_backend(backend, names, args.out, args.np, args.per_test_timeout,
                                       declare_features=not args.no_declare_features, mpich=args.mpich)
    summary = {"np": args.np, "tests": len(names), "mpi": "mpich" if args.mpich else "default",
               "seconds": round(time.time() - t0),
               "date": time.strftime("%Y-%m-%d", time.gmtime()),
               "counts": {b: counts(r) for b, r in results.items()}}
    if "accl" in results and "gloo" in results:
        worse = compare(results["accl"], results["gloo"])
        summary["accl_vs_gloo"] = {k: [r["test"] for r in v] for k, v in worse.items()}
        # torch marks a dozen all-to-all tests as MPI-backend-only ("Only MPI supports ..."): accl is an MPI backend
        mpi_only = [r["test"] for r in results["accl"] if r["outcome"] == "skip" and r["detail"].startswith("Only MPI")]
        summary["accl_vs_gloo"]["skip_as_mpi_only"] = mpi_only
        gated = summary["accl_vs_gloo"]["skip_on_accl_run_on_gloo"] + mpi_only
        if gated:  # what accl does with the tests torch marks as not for it, run anyway
            forced = run_backend("accl", gated, args.out, args.np, args.per_test_timeout,
                                 declare_features=not args.no_declare_features, ignore_skip_markers=True,
                                 tag="-skip-markers-ignored")
            summary["accl_skipped_tests_run_anyway"] = {
                r["test"]: {"outcome": r["outcome"], "why": _last_line(r["detail"])} for r in forced}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for b, c in summary["counts"].items():
        print(f"{b}: " + ", ".join(f"{v} {k}" for k, v in c.items()) + f" (of {len(names)}, {args.np} ranks)")
    for k, v in summary.get("accl_vs_gloo", {}).items():
        print(f"{k}: {len(v)}" + "".join(f"\n  {t}" for t in v))
    forced = summary.get("accl_skipped_tests_run_anyway", {})
    if forced:
        c = counts([{"outcome": v["outcome"]} for v in forced.values()])
        print(f"those {len(forced)} run on accl with torch's skip markers ignored: "
              + ", ".join(f"{n} {k}" for k, n in c.items()))
        for t, v in forced.items():
            print(f"  {t}: {v['outcome']}" + (f" ({v['why']})" if v["outcome"] != "pass" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
