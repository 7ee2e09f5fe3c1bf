"""``torchhpc jobscript``: a PBS or Slurm job script for the user's own training command, from the site profile.

The script comes from the same generator as the build and test jobs (``utils/submit_job.sh``, shape ``run``):
the scheduler's directives for the nodes, ranks, GPUs, walltime, account and queue asked for; the built
environment and the site's runtime settings activated on the compute node (``config_env.sh``); the command
started once per rank with the site's launcher (``mpiexec`` or ``srun``, ``utils/run_ranks.sh``), from the
directory ``torchhpc jobscript`` was called in.  It prints the script, writes it (``-o``), or submits it and
follows the job to its end (``--submit``), or submits and returns (``--detach``).

The job's Python environment is the site's built one (``--env site``) or the one running this command, with the
modules loaded now (``--env current``: a venv, a conda environment, a centre's PyTorch module); by default the
site's where it holds torch and torchhpc, else the current one.  Before anything is submitted the chosen one is
checked to hold both, and refused with the fix otherwise: a job never starts in an environment that cannot run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from .runtime import private

_CHECKOUT_FILES = ("config_env.sh", "utils/submit_job.sh", "utils/run_ranks.sh")


def find_checkout(explicit: str | None = None) -> Path:
    """The torchhpc checkout whose site profiles and job layer the script uses: ``--checkout``, else
    ``TORCHHPC_ROOT`` (set by ``config_env.sh``), else the checkout this package was installed from.  Never one
    found by looking around the current directory: under a world-writable directory that would run a stranger's
    scripts as the user (git refuses such repositories for the same reason)."""
    given = explicit or os.environ.get("TORCHHPC_ROOT")  # named: that one or none
    path = Path(given) if given else Path(__file__).resolve().parents[2]
    if not all((path / name).is_file() for name in _CHECKOUT_FILES):
        where = given or f"{path} (this package's source)"
        needs = ", ".join(_CHECKOUT_FILES)
        raise SystemExit(f"torchhpc jobscript: no torchhpc checkout at {where} (it needs {needs}); "
                         "pass --checkout DIR or source its config_env.sh")
    path = path.resolve()
    _check_checkout(path, named=bool(given))
    return path


def _check_checkout(root: Path, named: bool) -> None:
    """Refuse a checkout whose scripts another user could change: any of them (or a folder above them)
    writable by others, or, unless the user named it, owned by someone other than the user or root."""
    owners = (0,) if not named else tuple({os.stat(root).st_uid, 0})  # naming one trusts its owner (a site's)
    paths = [root, root / "utils", root / "utils" / "lib", *(root / n for n in _CHECKOUT_FILES),
             *sorted((root / "utils" / "lib").glob("*.sh"))]
    for path in paths:
        try:
            private.check_trusted(path.resolve(), owners=owners)
        except private.UnsafePathError as exc:
            raise SystemExit(f"torchhpc jobscript: refusing the checkout {root}: {exc}. Use a checkout of your "
                             "own, or have its owner make it writable by them alone") from None


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
                    "nodes asked for, with the site's runtime settings, in its built environment or yours (--env).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="site directives: the profile's extra scheduler options, replaced for one job from the environment:\n"
               "  PBS_EXTRA='-l job_priority=premium' (qsub options), SLURM_EXTRA='--constraint=gpu --qos=debug'\n"
               "  (#SBATCH lines, one option each); docs/cluster.md lists each profile's\n\n"
               "example: torchhpc jobscript --nodes 2 --ranks-per-node 4 --walltime 01:00:00 --account UABC0001 \\\n"
               "           --submit -- python examples/train.py --epochs 10")
    ap.add_argument("--nodes", type=int, default=None, help="compute nodes (default 1)")
    ap.add_argument("--spare-nodes", type=int, default=None,
                    help="nodes held beyond --nodes: when one of the step's nodes fails, the step starts again at "
                         "once on a spare in its place, resuming from your checkpoint (docs/restart.md)")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="ranks on each node (default: the site's GPUs per node)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: the site's; 0 for CPU jobs)")
    ap.add_argument("--cpus", type=int, default=None,
                    help="cores per rank (PBS: ncpus = this x ranks per node; Slurm: --cpus-per-task); default: the "
                         "site's cores per node shared by its ranks")
    ap.add_argument("--walltime", default=None, help="HH:MM:SS (default: the site's test walltime)")
    ap.add_argument("--account", default=None, help="project or account to charge (PBS -A, Slurm --account)")
    ap.add_argument("--queue", "--partition", dest="queue", default=None, help="PBS queue or Slurm partition")
    ap.add_argument("--scheduler", choices=("pbs", "slurm"), default=None,
                    help="default: the site profile's (the generic one detects qsub or sbatch)")
    ap.add_argument("--site", default=None, help="site profile (utils/sites/*.sh; default: detected)")
    ap.add_argument("--launcher", choices=("mpiexec", "srun"), default=None,
                    help="how ranks start (default: the site's; srun only under Slurm)")
    ap.add_argument("--name", default=None, help="job name (default: from the command's script)")
    ap.add_argument("--env", choices=("auto", "site", "current"), default="auto",
                    help="the job's Python: the site's built environment, or the one running this command with "
                         "the modules loaded now (auto: the site's where it holds torch and torchhpc, else current)")
    ap.add_argument("--checkout", default=None,
                    help="the torchhpc checkout whose site profiles and job layer to use (default: $TORCHHPC_ROOT, "
                         "which config_env.sh sets, else the checkout this torchhpc was installed from)")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("-o", "--output", default=None, help="write the script to this file instead of printing it")
    out.add_argument("--submit", action="store_true",
                     help="submit it and wait, showing progress, then its log; exit with the job's status")
    out.add_argument("--detach", action="store_true",
                     help="submit it and return; `make job-wait JOB=NAME` follows it later")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]: what each rank runs")
    return ap


_HOLDS = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('torch') and u.find_spec('torchhpc') else 3)"


def _holds_torch(python: Path) -> bool:
    """Whether ``python`` finds torch and torchhpc (looked up, not imported: a login node may lack a GPU's libraries
    that the compute nodes have)."""
    try:
        return subprocess.run([str(python), "-c", _HOLDS], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _site_env(checkout: Path, env: dict[str, str]) -> Path:
    """The site's built environment for this configuration, as config_env.sh names it (nothing is activated)."""
    quiet = {**env, "TORCHHPC_NO_ENV": "1", "TORCHHPC_NO_MODULES": "1", "TORCHHPC_QUIET": "1"}
    proc = subprocess.run(["bash", "-c", 'source ./config_env.sh && printf %s "$TORCHHPC_ENV_PREFIX"'], cwd=checkout,
                          env=quiet, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or not proc.stdout:
        raise SystemExit(f"torchhpc jobscript: config_env.sh failed: {proc.stderr.strip()}")
    return Path(proc.stdout)


def choose_env(choice: str, checkout: Path, env: dict[str, str]) -> dict[str, str]:
    """The variables that put the job in the chosen Python environment, after checking it holds torch and
    torchhpc; SystemExit with the fix when it does not."""
    prog = env.get("TORCHHPC_PROG", "torchhpc jobscript")
    if choice == "auto" and env.get("TORCHHPC_NO_ENV") == "1":
        choice = "current"  # the site's environment switched off by hand: the one at hand, as before
    site = _site_env(checkout, env)
    site_ok = _holds_torch(site / "bin" / "python")
    current = Path(sys.prefix)
    current_ok = _holds_torch(Path(sys.executable))
    if choice == "site" or (choice == "auto" and site_ok):
        if not site_ok:
            raise SystemExit(f"{prog}: the site's environment {site} does not hold torch and "
                             "torchhpc: build it (make build-pytorch-<version>-pbs or -slurm, then make "
                             "install-packages), or run the job in this one: --env current")
        return {}
    if not current_ok:
        raise SystemExit(f"{prog}: neither the site's environment ({site}) nor this one ({current}) "
                         "holds torch and torchhpc: activate one that does (pip install torch, then torchhpc), "
                         "or build the site's (make build-pytorch-<version>-pbs or -slurm)")
    if choice == "auto":
        print(f"{prog}: the site's environment {site} does not hold torch and torchhpc yet: the job "
              f"runs in this one, {current} (--env site insists)", file=sys.stderr)
    conda = env.get("CONDA_EXE")
    return {"TORCHHPC_JOB_PYENV": str(current), "TORCHHPC_JOB_MODULES": env.get("LOADEDMODULES", ""),
            "TORCHHPC_JOB_CONDA_SH": str(Path(conda).parents[1] / "etc/profile.d/conda.sh") if conda else ""}


def submit_args(ns: argparse.Namespace, checkout: Path, command: Sequence[str],
                record: Path | None = None) -> list[str]:
    """The ``utils/submit_job.sh`` command line for these options (the one route to a job script); ``record``:
    a file the job's record (scheduler, id, log) is appended to at each submission."""
    args = ["bash", str(checkout / "utils/submit_job.sh"), "--shape", "run",
            "--name", ns.name or _job_name(command), "--workdir", str(Path.cwd())]
    for flag, value in (("--nodes", ns.nodes), ("--spare-nodes", ns.spare_nodes),
                        ("--ranks-per-node", ns.ranks_per_node), ("--gpus", ns.gpus),
                        ("--cpus", ns.cpus), ("--walltime", ns.walltime), ("--account", ns.account),
                        ("--queue", ns.queue), ("--scheduler", ns.scheduler)):
        if value is not None:
            args += [flag, str(value)]
    if record is not None:
        args += ["--record", str(record)]
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
    env = {**os.environ, "TORCHHPC_PROG": "torchhpc jobscript"}
    if ns.site:
        env["SITE"] = ns.site
    if ns.launcher:
        env["LAUNCHER"] = ns.launcher
    env.update(choose_env(ns.env, checkout, env))
    args = submit_args(ns, checkout, command)
    if ns.output is None:
        return subprocess.run(args, env=env, check=False).returncode
    proc = subprocess.run(args, env=env, check=False, stdout=subprocess.PIPE, text=True)
    if proc.returncode == 0:
        Path(ns.output).write_text(proc.stdout)
        print(f"torchhpc jobscript: wrote {ns.output}; submit it with "
              f"{'sbatch' if '#SBATCH' in proc.stdout else 'qsub'} {ns.output}", file=sys.stderr)
    return proc.returncode
