"""``torchhpc jobscript``: a PBS or Slurm job script for the user's own training command, from the site profile.

The script comes from the same generator as the build and test jobs (``utils/submit_job.sh``, shape ``run``):
the scheduler's directives for the nodes, ranks, GPUs, walltime, account and queue asked for; the built
environment and the site's runtime settings activated on the compute node (``config_env.sh``); the command
started once per rank with the site's launcher (``mpiexec`` or ``srun``, ``utils/run_ranks.sh``), from the
directory ``torchhpc jobscript`` was called in.  It prints the script, writes it (``-o``), or submits it and
follows the job to its end (``--submit``), or submits and returns (``--detach``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

_CHECKOUT_FILES = ("config_env.sh", "utils/submit_job.sh", "utils/run_ranks.sh")


def find_checkout(explicit: str | None = None) -> Path:
    """The torchhpc checkout whose site profiles and job layer the script uses: ``--checkout``, else
    ``TORCHHPC_ROOT`` (set by ``config_env.sh``), else the current directory or one above it, else the checkout
    this package was installed from in editable mode."""
    here = Path.cwd().resolve()
    given = explicit or os.environ.get("TORCHHPC_ROOT")  # named: that one or none
    candidates = [Path(given)] if given else [here, *here.parents, Path(__file__).resolve().parents[2]]
    for path in candidates:
        if all((path / name).is_file() for name in _CHECKOUT_FILES):
            return path.resolve()
    where = given or "the current directory, its parents and this package's source"
    needs = ", ".join(_CHECKOUT_FILES)
    raise SystemExit(f"torchhpc jobscript: no torchhpc checkout found in {where} (it needs {needs}); "
                     "run it from the checkout you built with, or pass --checkout DIR")


def _job_name(command: Sequence[str]) -> str:
    """A scheduler-safe job name from the command: its first script or program, e.g. ``train`` for
    ``python train.py --epochs 3``."""
    words = [w for w in command if not w.startswith("-")]
    script = next((w for w in words if w.endswith(".py")), words[0] if words else "job")
    name = re.sub(r"[^A-Za-z0-9._-]", "-", Path(script).stem).strip("-.") or "job"
    return name if name[0].isalpha() else f"job-{name}"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="torchhpc jobscript",
        description="Write (or submit) a PBS or Slurm job script that runs COMMAND once per rank across the "
                    "nodes asked for, in the site's built environment with its runtime settings.",
        epilog="example: torchhpc jobscript --nodes 2 --ranks-per-node 4 --walltime 01:00:00 --account UABC0001 "
               "--submit -- python train.py --epochs 10")
    ap.add_argument("--nodes", type=int, default=None, help="compute nodes (default 1)")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="ranks on each node (default: the site's GPUs per node)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: the site's; 0 for CPU jobs)")
    ap.add_argument("--cpus", type=int, default=None,
                    help="PBS: cores per node (ncpus); Slurm: cores per rank (--cpus-per-task)")
    ap.add_argument("--walltime", default=None, help="HH:MM:SS (default: the site's test walltime)")
    ap.add_argument("--account", default=None, help="project or account to charge (PBS -A, Slurm --account)")
    ap.add_argument("--queue", "--partition", dest="queue", default=None, help="PBS queue or Slurm partition")
    ap.add_argument("--scheduler", choices=("pbs", "slurm"), default=None,
                    help="default: the site profile's (the generic one detects qsub or sbatch)")
    ap.add_argument("--site", default=None, help="site profile (utils/sites/*.sh; default: detected)")
    ap.add_argument("--launcher", choices=("mpiexec", "srun"), default=None,
                    help="how ranks start (default: the site's; srun only under Slurm)")
    ap.add_argument("--name", default=None, help="job name (default: from the command's script)")
    ap.add_argument("--checkout", default=None, help="the torchhpc checkout (default: found, see --help)")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("-o", "--output", default=None, help="write the script to this file instead of printing it")
    out.add_argument("--submit", action="store_true",
                     help="submit it and wait, showing progress, then its log; exit with the job's status")
    out.add_argument("--detach", action="store_true",
                     help="submit it and return; `make job-wait JOB=NAME` follows it later")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]: what each rank runs")
    return ap


def submit_args(ns: argparse.Namespace, checkout: Path, command: Sequence[str]) -> list[str]:
    """The ``utils/submit_job.sh`` command line for these options (the one route to a job script)."""
    args = ["bash", str(checkout / "utils/submit_job.sh"), "--shape", "run",
            "--name", ns.name or _job_name(command), "--workdir", str(Path.cwd())]
    for flag, value in (("--nodes", ns.nodes), ("--ranks-per-node", ns.ranks_per_node), ("--gpus", ns.gpus),
                        ("--cpus", ns.cpus), ("--walltime", ns.walltime), ("--account", ns.account),
                        ("--queue", ns.queue), ("--scheduler", ns.scheduler)):
        if value is not None:
            args += [flag, str(value)]
    if ns.detach:
        args.append("--detach")
    elif not ns.submit:
        args.append("--print-script")
    return [*args, "--", "bash", str(checkout / "utils/run_ranks.sh"), *command]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``torchhpc jobscript``; returns the exit status (the job's, with ``--submit``)."""
    ap = _parser()
    ns = ap.parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        ap.error("no command: torchhpc jobscript [options] -- COMMAND [ARG...]")
    checkout = find_checkout(ns.checkout)
    env = dict(os.environ)
    if ns.site:
        env["SITE"] = ns.site
    if ns.launcher:
        env["LAUNCHER"] = ns.launcher
    args = submit_args(ns, checkout, command)
    if ns.output is None:
        return subprocess.run(args, env=env, check=False).returncode
    proc = subprocess.run(args, env=env, check=False, stdout=subprocess.PIPE, text=True)
    if proc.returncode == 0:
        Path(ns.output).write_text(proc.stdout)
        print(f"torchhpc jobscript: wrote {ns.output}; submit it with "
              f"{'sbatch' if '#SBATCH' in proc.stdout else 'qsub'} {ns.output}", file=sys.stderr)
    return proc.returncode
