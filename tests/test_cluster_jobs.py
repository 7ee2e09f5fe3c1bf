"""The job layer (utils/submit_job.sh + utils/lib/jobs.sh) without a scheduler: one generator for PBS and
Slurm job scripts, directive syntax checks, scheduler detection, as DRY_RUN=1 prints them.  Slurm runs for
real in test_cluster_slurm.py, PBS (OpenPBS on the virtual cluster) in test_vcluster_pbs.py.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USER = pwd.getpwuid(os.geteuid()).pw_name  # job scripts and logs go to build/jobs/<user>


def submit(tmp_path: Path, *args: str, path: str = "/usr/bin:/bin", **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": f"{Path(sys.executable).parent}:{path}", "HOME": str(tmp_path), "LANG": "C",
            "TORCHHPC_PREFIX": str(tmp_path / "build"), "DRY_RUN": "1", "SITE": "generic"}
    return subprocess.run(["bash", "utils/submit_job.sh", "--name", "j", *args], cwd=ROOT, env={**base, **env},
                          capture_output=True, text=True, timeout=60)


def script_lines(stdout: str) -> tuple[list[str], str]:
    script, _, line = stdout.partition("# submit command:\n")
    return script.splitlines()[1:], line.strip()


def test_pbs_and_slurm_scripts_come_from_one_generator(tmp_path: Path) -> None:
    cmd = ["--shape", "test", "--", "echo", "a b"]
    pbs, pbs_submit = script_lines(submit(tmp_path, "--scheduler", "pbs", *cmd).stdout)
    slurm, slurm_submit = script_lines(submit(tmp_path, "--scheduler", "slurm", *cmd).stdout)
    assert pbs[0] == "#!/bin/bash -l" and slurm[0] == "#!/bin/bash"
    pbs_body = [line for line in pbs[1:] if not line.startswith("#PBS")]
    own_log = f'exec >>{tmp_path}/build/jobs/{USER}/j-"${{PBS_JOBID}}".log 2>&1'  # one log per job id
    assert own_log in pbs_body, "a PBS job writes its own log as it goes"
    pbs_body.remove(own_log)
    slurm_body = [line for line in slurm[1:] if not line.startswith("#SBATCH")]
    assert [line.replace("(pbs)", "(X)").replace("=pbs", "=X") for line in pbs_body] == \
        [line.replace("(slurm)", "(X)").replace("=slurm", "=X") for line in slurm_body]
    assert pbs_body[-1] == "echo a\\ b"
    assert pbs_submit == f"qsub {tmp_path}/build/jobs/{USER}/j.pbs"
    assert slurm_submit == f"sbatch --parsable {tmp_path}/build/jobs/{USER}/j.slurm"
    assert "#SBATCH --nodes=2" in slurm and "#SBATCH --ntasks-per-node=4" in slurm
    assert "#SBATCH --gpus-per-node=4" in slurm and "#SBATCH --time=00:15:00" in slurm
    assert f"#SBATCH --output={tmp_path}/build/jobs/{USER}/j-%j.log" in slurm
    assert "#PBS -l select=2:ncpus=32:mpiprocs=4:ngpus=4" in pbs
    assert f"#PBS -o {tmp_path}/build/jobs/{USER}/j.pbs-out" in pbs


def test_pbs_test_jobs_take_whole_hosts_unless_the_site_says_where(tmp_path: Path) -> None:
    test, _ = script_lines(submit(tmp_path, "--scheduler", "pbs", "--shape", "test", "--", "true").stdout)
    build, _ = script_lines(submit(tmp_path, "--scheduler", "pbs", "--shape", "build", "--", "true").stdout)
    one, _ = script_lines(submit(tmp_path, "--scheduler", "pbs", "--shape", "test", "--select", "1:ncpus=4",
                                 "--", "true").stdout)
    site, _ = script_lines(submit(tmp_path, "--scheduler", "pbs", "--shape", "test", "--", "true",
                                  PBS_EXTRA="-l place=pack").stdout)
    assert "#PBS -l place=scatter:excl" in test
    assert not any("place=scatter" in line for line in build + one + site), (build, one, site)
    assert "#PBS -l place=pack" in site


def test_knobs_set_at_submission_are_written_into_the_job(tmp_path: Path) -> None:
    """Only what the user set, before config_env.sh derives its own values (CUDA_HOME, MAX_JOBS, ...)."""
    lines, _ = script_lines(submit(tmp_path, "--scheduler", "pbs", "--shape", "build", "--", "true",
                                   STOP_AFTER="patches", PYTORCH_GIT="file:///a b").stdout)
    exports = [line for line in lines if line.startswith("export ") and "SITE=" not in line]
    assert exports == ["export STOP_AFTER=patches", "export PYTORCH_GIT=file:///a\\ b"], exports
    assert not any(line.startswith("source ") for line in lines), "no venv unless TORCHHPC_NO_ENV=1"


def test_slurm_overrides_and_options(tmp_path: Path) -> None:
    out = submit(tmp_path, "--scheduler", "slurm", "--shape", "build", "--", "true", SLURM_ACCOUNT="proj1",
                 SLURM_PARTITION="gpu", SLURM_CPUS_BUILD="64", SLURM_GPUS_BUILD="1", SLURM_TIME_BUILD="1-00:00:00",
                 SLURM_EXTRA="--exclusive --constraint=a100").stdout
    lines, _ = script_lines(out)
    for line in ("--account=proj1", "--partition=gpu", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=64",
                 "--gpus-per-node=1", "--time=1-00:00:00", "--exclusive", "--constraint=a100"):
        assert f"#SBATCH {line}" in lines, line


@pytest.mark.parametrize(("select", "message"), [
    ("2:ncpus=64:mpiprocs=4:ngpus=4", ""),
    ("1:ncpus=64:mem=235GB+1:ncpus=8", ""),
    ("2:ncpus=lots", "has ncpus=lots (a whole number is needed)"),
    ("2:ngpus=4.5", "has ngpus=4.5"),
    ("0:ncpus=4", "asks for 0 chunks"),
    ("ncpus=4", "is not a PBS select statement"),
    ("2:ncpus=4 -l walltime=99:00:00", "is not a PBS select statement"),
    ("2:NCPUS=4", "is not a PBS select statement"),
])
def test_pbs_select_syntax(tmp_path: Path, select: str, message: str) -> None:
    proc = submit(tmp_path, "--scheduler", "pbs", "--shape", "test", "--select", select, "--", "true")
    if message:
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert f"#PBS -l select={select}" in proc.stdout


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--walltime", "20min", "is not HH:MM:SS"),
    ("--walltime", "1:99:00", "is not HH:MM:SS"),
    ("--queue", "main queue", "is not a PBS queue name"),
    ("--account", "NTDD 0001", "has characters no scheduler accepts"),
    ("--submit", "sbatch", "is not qcmd or qsub"),
])
def test_pbs_directive_values(tmp_path: Path, option: str, value: str, message: str) -> None:
    proc = submit(tmp_path, "--scheduler", "pbs", "--shape", "build", option, value, "--", "true")
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_qcmd_carries_resources_on_its_command_line(tmp_path: Path) -> None:
    out = submit(tmp_path, "--scheduler", "pbs", "--shape", "build", "--submit", "qcmd", "--account", "P1",
                 "--queue", "develop", "--", "true").stdout
    _, line = script_lines(out)
    assert line == (f"qcmd -N j -q develop -l select=1:ncpus=32 -l walltime=04:00:00 -A P1 -- bash -l "
                    f"{tmp_path}/build/jobs/{USER}/j.pbs")


def test_bad_names_shapes_and_schedulers(tmp_path: Path) -> None:
    for args, message in ((["--scheduler", "lsf"], "SCHEDULER 'lsf' is not pbs or slurm"),
                          (["--scheduler", "pbs", "--name", "9lives"], "is not a valid job name"),
                          (["--scheduler", "slurm", "--shape", "huge"], "--shape 'huge' is not build, test or run")):
        shape = [] if "--shape" in args else ["--shape", "build"]
        proc = submit(tmp_path, *args, *shape, "--", "true")
        assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr)


@pytest.mark.parametrize(("tools", "expected"), [((), "none"), (("qsub",), "pbs"), (("qsub", "sbatch"), "slurm")])
def test_generic_detects_the_scheduler_on_path(tmp_path: Path, tools: tuple[str, ...], expected: str) -> None:
    # Only `command -v` looks at these names; nothing runs them.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in Path("/usr/bin").iterdir():  # everything but the schedulers' commands this host may have
        if tool.name not in ("sbatch", "srun", "qsub", "qcmd"):
            (bindir / tool.name).symlink_to(tool)
    for tool in tools:
        (bindir / tool).write_text("#!/bin/sh\nexit 99\n")
        (bindir / tool).chmod(0o755)
    env = {"PATH": str(bindir), "HOME": str(tmp_path), "SITE": "generic", "TORCHHPC_NO_ENV": "1",
           "TORCHHPC_QUIET": "1", "TORCHHPC_PREFIX": str(tmp_path / "build")}
    proc = subprocess.run(["bash", "-c", "source ./config_env.sh && echo $TORCHHPC_SCHEDULER"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == expected, proc.stderr
    if expected == "none":
        out = subprocess.run(["bash", "utils/submit_job.sh", "--name", "j", "--shape", "build", "--", "true"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "neither sbatch nor qsub is on PATH" in out.stderr


def test_derecho_profile_says_pbs(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SITE": "derecho", "TORCHHPC_NO_ENV": "1",
           "TORCHHPC_NO_MODULES": "1", "TORCHHPC_QUIET": "1"}
    proc = subprocess.run(["bash", "-c", "source ./config_env.sh && echo $TORCHHPC_SCHEDULER"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "pbs"


# ---- torchhpc jobscript: the user's own command (shape run) --------------------------------------------------


def jobscript(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`torchhpc jobscript ARGS` from a user's directory (tmp_path/work), as on a login node without a scheduler."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C",
            "TORCHHPC_PREFIX": str(tmp_path / "build"), "SITE": "generic", "TORCHHPC_ROOT": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "torchhpc", "jobscript", *args], cwd=work, env={**base, **env},
                          capture_output=True, text=True, timeout=60)


def test_jobscript_pbs_asks_for_the_nodes_and_ranks_and_runs_the_command_per_rank(tmp_path: Path) -> None:
    proc = jobscript(tmp_path, "--scheduler", "pbs", "--nodes", "3", "--ranks-per-node", "2", "--gpus", "0",
                     "--walltime", "01:30:00", "--account", "P1", "--", "python", "train.py", "--lr", "0.1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "#!/bin/bash -l" and "#PBS -N train" in lines and "#PBS -A P1" in lines
    # the node's cores from the site's test select (32 on the generic profile) shared by 2 ranks; no GPUs asked for
    assert "#PBS -l select=3:ncpus=32:mpiprocs=2" in lines and "#PBS -l walltime=01:30:00" in lines
    assert "#PBS -l place=scatter:excl" in lines, "one chunk per host"
    own_log = f'exec >>{tmp_path}/build/jobs/{USER}/train-"${{PBS_JOBID}}".log 2>&1'
    assert own_log in lines, "the job writes its log as it goes"
    assert f"cd {tmp_path}/work" in lines, "the job runs where jobscript was called"
    assert lines[-1] == f"bash {ROOT}/utils/run_ranks.sh python train.py --lr 0.1"
    assert (tmp_path / "build/jobs" / USER).is_dir(), "the log's directory exists before the script is submitted"


def test_jobscript_slurm_shares_the_nodes_cores_among_its_ranks(tmp_path: Path) -> None:
    proc = jobscript(tmp_path, "--scheduler", "slurm", "--nodes", "2", "--ranks-per-node", "2", "--gpus", "1",
                     "--partition", "gpu", "--", "python", "train.py")
    lines = proc.stdout.splitlines()
    assert {"#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=1",
            "#SBATCH --partition=gpu"} <= set(lines), proc.stdout + proc.stderr
    # the generic profile's test job: 4 tasks x 8 cores per node, so 16 cores for each of 2 ranks
    assert "#SBATCH --cpus-per-task=16" in lines


def test_jobscript_uses_the_site_profile(tmp_path: Path) -> None:
    proc = jobscript(tmp_path, "--nodes", "2", "--account", "UABC0001", "--", "python", "train.py",
                     SITE="derecho", TORCHHPC_NO_MODULES="1")
    lines = proc.stdout.splitlines()
    assert {"#PBS -q main", "#PBS -l select=2:ncpus=64:mpiprocs=4:ngpus=4", "#PBS -l job_priority=regular",
            "export SITE=derecho PYTORCH_VERSION=2.13.0 TORCHHPC_PREFIX=" + str(tmp_path / "build")
            + " SCHEDULER=pbs"} <= set(lines), proc.stdout + proc.stderr
    refused = jobscript(tmp_path, "--submit", "--", "python", "train.py", SITE="derecho", TORCHHPC_NO_MODULES="1")
    assert refused.returncode != 0 and "needs a project account" in refused.stderr and "--account" in refused.stderr


def test_jobscript_writes_a_file_and_refuses_bad_input(tmp_path: Path) -> None:
    out = tmp_path / "train.slurm"
    proc = jobscript(tmp_path, "--scheduler", "slurm", "-o", str(out), "--", "python", "train.py")
    assert proc.returncode == 0 and out.read_text().startswith("#!/bin/bash\n#SBATCH --job-name=train\n")
    assert f"sbatch {out}" in proc.stderr
    for args, message in ((["--", ], "no command"), (["--nodes", "0", "--scheduler", "pbs", "--", "x"],
                                                     "--nodes '0' is not a positive whole number"),
                          (["--walltime", "1h", "--scheduler", "slurm", "--", "x"], "--walltime '1h' is not HH:MM:SS")):
        proc = jobscript(tmp_path, *args)
        assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr)
    lost = jobscript(tmp_path, "--", "x", TORCHHPC_ROOT=str(tmp_path))
    assert lost.returncode != 0 and "no torchhpc checkout at" in lost.stderr, lost.stderr


def test_jobscript_counts_cores_per_rank_under_both_schedulers(tmp_path: Path) -> None:
    """One core count whatever the scheduler: --cpus is per rank; the profile's default is the same node size."""
    asked = {"pbs": "#PBS -l select=2:ncpus=6:mpiprocs=2", "slurm": "#SBATCH --cpus-per-task=3"}
    for scheduler, line in asked.items():
        proc = jobscript(tmp_path, "--scheduler", scheduler, "--nodes", "2", "--ranks-per-node", "2", "--cpus", "3",
                         "--gpus", "0", "--", "python", "train.py")
        assert line in proc.stdout.splitlines(), proc.stdout + proc.stderr
    pbs = jobscript(tmp_path, "--scheduler", "pbs", "--ranks-per-node", "4", "--", "x").stdout
    slurm = jobscript(tmp_path, "--scheduler", "slurm", "--ranks-per-node", "4", "--", "x").stdout
    assert "ncpus=32:mpiprocs=4" in pbs and "#SBATCH --cpus-per-task=8" in slurm.splitlines(), pbs + slurm


def test_jobscript_speaks_in_its_own_name_and_flags(tmp_path: Path) -> None:
    """Errors name the command and the flag the user types; no account is warned of; --help lists the site
    directives."""
    bad = jobscript(tmp_path, "--scheduler", "pbs", "--walltime", "1h", "--", "x")
    assert "\ntorchhpc jobscript: error: --walltime '1h'" in bad.stderr, bad.stderr
    bindir = tmp_path / "bin"  # a login node without either scheduler's commands
    bindir.mkdir()
    for tool in Path("/usr/bin").iterdir():
        if tool.name not in ("sbatch", "srun", "qsub", "qcmd"):
            (bindir / tool.name).symlink_to(tool)
    none = jobscript(tmp_path, "--", "x", PATH=f"{Path(sys.executable).parent}:{bindir}")
    assert none.returncode != 0 and "pass --scheduler slurm|pbs" in none.stderr, none.stderr
    plain = jobscript(tmp_path, "--scheduler", "slurm", "--", "x")
    assert plain.returncode == 0 and "warning: no account given" in plain.stderr, plain.stderr
    charged = jobscript(tmp_path, "--scheduler", "slurm", "--account", "A1", "--", "x")
    assert "warning" not in charged.stderr, charged.stderr
    helped = jobscript(tmp_path, "--help").stdout
    assert "PBS_EXTRA=" in helped and "SLURM_EXTRA=" in helped and "$TORCHHPC_ROOT" in helped, helped


def fake_tools(tmp_path: Path, **scripts: str) -> str:
    """A PATH whose named commands print the given text (a scheduler's answers), then this host's."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir(exist_ok=True)
    for name, text in scripts.items():
        (bindir / name).write_text(f"#!/bin/sh\nprintf '%s\\n' '{text}'\n")
        (bindir / name).chmod(0o755)
    return f"{Path(sys.executable).parent}:{bindir}:/usr/bin:/bin"


def test_jobscript_runs_the_job_in_an_environment_that_holds_torch(tmp_path: Path) -> None:
    """auto: the site's built environment where it holds torch and torchhpc, else this one (said), with the modules
    loaded now; --env site refuses an empty one before submitting, naming the build."""
    here = Path(sys.prefix)
    plain = jobscript(tmp_path, "--scheduler", "slurm", "--", "python", "train.py", LOADEDMODULES="gcc/12:cuda/12.6")
    lines = plain.stdout.splitlines()
    assert "does not hold torch and torchhpc yet: the job runs in this one" in plain.stderr, plain.stderr
    assert "export TORCHHPC_NO_ENV=1 TORCHHPC_NO_MODULES=1" in lines and "module load gcc/12 cuda/12.6 " in lines
    assert f"source {here}/bin/activate" in lines, plain.stdout
    refused = jobscript(tmp_path, "--env", "site", "--scheduler", "slurm", "--", "python", "train.py")
    assert refused.returncode != 0 and refused.stdout == "", refused.stdout
    assert "make build-pytorch-" in refused.stderr and "--env current" in refused.stderr, refused.stderr
    built = tmp_path / "site-env"  # a site environment that holds both: this one's python
    (built / "bin").mkdir(parents=True)
    (built / "bin" / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (built / "bin" / "python").chmod(0o755)
    site = jobscript(tmp_path, "--scheduler", "slurm", "--", "python", "train.py",
                     TORCHHPC_ENV_PREFIX_OVERRIDE=str(built))
    assert site.returncode == 0 and "TORCHHPC_NO_ENV" not in site.stdout and "activate" not in site.stdout, site.stdout


def test_a_job_never_creates_an_empty_environment(tmp_path: Path) -> None:
    """config_env.sh inside a batch job with no environment built: an error naming the fix, nothing created;
    outside one (a person at a login node) it creates the environment, saying so."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SITE": "generic", "TORCHHPC_NO_MODULES": "1",
           "TORCHHPC_PREFIX": str(tmp_path / "build"), "TORCHHPC_VENV_ARGS": "--without-pip", "ENV_KIND": "venv"}
    script = "source ./config_env.sh; echo rc=$?"
    job = subprocess.run(["bash", "-c", script], cwd=ROOT, env={**env, "SLURM_JOB_ID": "7"}, capture_output=True,
                         text=True, timeout=60)
    assert "rc=1" in job.stdout and "no environment at" in job.stderr and "--env current" in job.stderr, job.stderr
    assert not (tmp_path / "build" / "envs").exists() or not any((tmp_path / "build" / "envs").iterdir())
    login = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "rc=0" in login.stdout and "creating venv" in login.stderr, login.stderr
    assert "no torch installed yet" in login.stderr and "build targets: PyTorch" in login.stderr, login.stderr


@pytest.mark.parametrize(("scheduler", "tool", "answer", "gpus"), [
    ("slurm", "sinfo", "(null)", 0), ("slurm", "sinfo", "gpu:a100:4", 4),
    ("pbs", "pbsnodes", "resources_available.ncpus = 2", 0), ("pbs", "pbsnodes", "resources_available.ngpus = 4", 4)])
def test_a_cpu_only_cluster_needs_no_gpus_flag(tmp_path: Path, scheduler: str, tool: str, answer: str,
                                               gpus: int) -> None:
    proc = jobscript(tmp_path, "--scheduler", scheduler, "--nodes", "2", "--", "python", "train.py",
                     PATH=fake_tools(tmp_path, **{tool: answer}))
    asked = {"slurm": "#SBATCH --gpus-per-node=4", "pbs": ":ngpus=4"}[scheduler]
    assert (asked in proc.stdout) == (gpus == 4), proc.stdout + proc.stderr
    assert ("reports no GPUs" in proc.stderr) == (gpus == 0), proc.stderr


def test_spare_nodes_are_asked_for_and_kept_through_a_node_failure(tmp_path: Path) -> None:
    """--spare-nodes K: N+K nodes, an allocation that outlives a failed node (Slurm --no-kill, PBS
    tolerate_node_failures), and the count handed to the supervisor (utils/run_ranks.sh) in the job."""
    common = ("--nodes", "2", "--spare-nodes", "1", "--ranks-per-node", "1", "--gpus", "0", "--account", "P1")
    slurm = jobscript(tmp_path, "--scheduler", "slurm", *common, "--", "python", "train.py").stdout.splitlines()
    assert {"#SBATCH --nodes=3", "#SBATCH --no-kill"} <= set(slurm), slurm
    assert any(line.startswith("export SITE=") and line.endswith(" TORCHHPC_SPARE_NODES=1") for line in slurm)
    pbs = jobscript(tmp_path, "--scheduler", "pbs", *common, "--", "python", "train.py").stdout.splitlines()
    assert "#PBS -l select=3:ncpus=32:mpiprocs=1" in pbs and "#PBS -W tolerate_node_failures=all" in pbs, pbs
    plain = jobscript(tmp_path, "--scheduler", "slurm", "--nodes", "2", "--", "python", "t.py").stdout
    assert "--no-kill" not in plain and "SPARE" not in plain
    bad = jobscript(tmp_path, "--scheduler", "slurm", "--spare-nodes=-1", "--", "python", "t.py")
    assert bad.returncode != 0 and "--spare-nodes '-1' is not a whole number" in bad.stderr, bad.stderr


def test_run_ranks_places_ranks_from_the_allocation(tmp_path: Path) -> None:
    """utils/run_ranks.sh inside a PBS job of 2 hosts x 3 ranks: one launcher line for 6 ranks, 3 per node."""
    nodefile = tmp_path / "nodes"
    nodefile.write_text("a\na\na\nb\nb\nb\n")
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "SITE": "generic",
           "TORCHHPC_NO_ENV": "1", "TORCHHPC_QUIET": "1", "PBS_NODEFILE": str(nodefile), "DRY_RUN": "1"}
    lines = {}
    for ncpus in ("12", "2"):  # PBS's NCPUS: the chunk's cores, shared by its 3 ranks (or too few to share)
        proc = subprocess.run(["bash", str(ROOT / "utils/run_ranks.sh"), "python", "t.py"], cwd=tmp_path,
                              env={**env, "NCPUS": ncpus}, capture_output=True, text=True, timeout=60)
        lines[ncpus] = proc.stdout.strip()
        assert f"2 node(s) x 3 rank(s) with mpiexec in {tmp_path}; bound: " in proc.stderr, proc.stderr
    assert lines["12"] == "+ mpiexec -n 6 --map-by ppr:3:node:PE=4 --bind-to core python t.py", lines
    # fewer cores than ranks: Open MPI told to yield its progress when idle (ranks and their helper threads share)
    assert lines["2"] == "+ mpiexec -n 6 --map-by ppr:3:node --bind-to none --mca mpi_yield_when_idle 1 python t.py", \
        lines


def test_a_build_on_an_older_cuda_than_its_release_is_refused_before_submitting(tmp_path: Path) -> None:
    """Derecho's default CUDA module (12.2) against PyTorch 2.13.0 (released for CUDA 12.6): refused with the
    way out named, before a multi-hour job is queued; a newer module, or the override, lets it through."""
    args = ("--scheduler", "pbs", "--shape", "build", "--account", "P1", "--", "true")
    base = {"SITE": "derecho", "TORCHHPC_NO_MODULES": "1", "PYTORCH_VERSION": "2.13.0", "DRY_RUN": "0"}
    refused = submit(tmp_path, *args, **base)
    assert refused.returncode != 0, refused.stdout
    assert "PyTorch 2.13.0 was released for CUDA 12.6; site 'derecho' builds with CUDA 12.2" in refused.stderr
    assert "CUDA_MODULE=" in refused.stderr and "make cluster-versions" in refused.stderr
    for extra in ({"CUDA_MODULE": "cuda/12.8.0"}, {"CUDA_MISMATCH_OK": "1"}, {"PYTORCH_VERSION": "2.4.1"}):
        proc = submit(tmp_path, *args, **{**base, **extra, "DRY_RUN": "1"})
        assert proc.returncode == 0 and "released for CUDA" not in proc.stderr, (extra, proc.stderr)
    warned = submit(tmp_path, *args, **{**base, "DRY_RUN": "1"})
    assert warned.returncode == 0 and "# warning: PyTorch 2.13.0 was released for CUDA 12.6" in warned.stderr


@pytest.mark.parametrize(("site", "module", "scheduler"), [("polaris", "cudatoolkit-standalone/12.4.1", "pbs"),
                                                            ("perlmutter", "cudatoolkit/12.4", "slurm")])
def test_the_centres_cuda_modules_are_checked_too(tmp_path: Path, site: str, module: str, scheduler: str) -> None:
    """Polaris' and Perlmutter's CUDA modules (cudatoolkit-standalone/, cudatoolkit/) are read like Derecho's cuda/:
    an older one is refused before the build is queued; the profile's own default is new enough."""
    args = ("--scheduler", scheduler, "--shape", "build", "--account", "P1", "--", "true")
    base = {"SITE": site, "TORCHHPC_NO_MODULES": "1", "PYTORCH_VERSION": "2.13.0", "DRY_RUN": "0"}
    refused = submit(tmp_path, *args, **base, CUDA_MODULE=module)
    assert refused.returncode != 0 and f"site '{site}' builds with CUDA 12.4" in refused.stderr, refused.stderr
    fits = submit(tmp_path, *args, **{**base, "DRY_RUN": "1"})
    assert fits.returncode == 0 and "released for CUDA" not in fits.stderr, fits.stderr


def test_polaris_and_perlmutter_jobs_ask_what_their_guides_say(tmp_path: Path) -> None:
    """`torchhpc jobscript --site polaris|perlmutter`: the directives each centre's user guide asks for."""
    polaris = jobscript(tmp_path, "--site", "polaris", "--nodes", "2", "--account", "P1", "--", "python", "t.py",
                        TORCHHPC_NO_MODULES="1").stdout.splitlines()
    assert {"#PBS -A P1", "#PBS -q preemptable", "#PBS -l select=2:ncpus=64:mpiprocs=4:ngpus=4:system=polaris",
            "#PBS -l place=scatter:excl", "#PBS -l filesystems=home:eagle"} <= set(polaris), polaris
    nersc = jobscript(tmp_path, "--site", "perlmutter", "--nodes", "2", "--account", "m0001", "--", "python", "t.py",
                      TORCHHPC_NO_MODULES="1").stdout.splitlines()
    assert {"#SBATCH --account=m0001", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
            "#SBATCH --cpus-per-task=32", "#SBATCH --gpus-per-node=4", "#SBATCH --constraint=gpu",
            "#SBATCH --qos=regular"} <= set(nersc), nersc
    for site in ("polaris", "perlmutter"):
        refused = jobscript(tmp_path, "--site", site, "--submit", "--", "python", "t.py", TORCHHPC_NO_MODULES="1")
        assert refused.returncode != 0 and "--account" in refused.stderr, refused.stderr


def _launch_line(**env: str) -> tuple[list[str], str]:
    """utils/lib/launch.sh's launch_resolve inside a made-up job: the launcher's argv and the binding said."""
    script = ("set -euo pipefail; source utils/lib/common.sh; source utils/lib/launch.sh; launch_resolve; "
              'printf "%s\\n" "${LAUNCH[@]}"; echo "BOUND $LAUNCH_BIND"')
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "DRY_RUN": "0", "TORCHHPC_SRUN_MPI": "pmix",
            "TORCHHPC_GPUS_PER_NODE": "2", "PYTHONPATH": str(ROOT / "src"),
            "HWLOC_XMLFILE": str(ROOT / "tests/data/hwloc/32em64t-2n8c2t-pci-normalio.xml")}
    res = subprocess.run(["bash", "-c", script], cwd=ROOT, env={**base, **env}, capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    return lines[:-1], lines[-1]


def test_a_job_holding_its_nodes_is_bound_from_their_topology_in_each_launchers_words(tmp_path: Path) -> None:
    """launch_resolve in a Slurm job of 2 nodes x 2 ranks on the two-socket machine of hwloc's XML (GPU and
    InfiniBand on NUMA node 1): srun's masks (and GPU words only where the job has GPUs), PALS' and Hydra's lists,
    Open MPI's self-binding with the maps passed on; a job given part of a node keeps the equal share."""
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)",
             "SLURM_CPUS_ON_NODE": str(max(32, os.cpu_count() or 1))}  # every CPU of this host: the node whole
    argv, bound = _launch_line(**slurm, TORCHHPC_LAUNCHER="srun", SLURM_GPUS_ON_NODE="2")
    assert argv[-2:] == ["--cpu-bind=mask_cpu:0xf000f00,0xf000f000", "--gpu-bind=map_gpu:0,0"], argv
    assert bound == "BOUND from the node's topology (hwloc XML " + str(
        ROOT / "tests/data/hwloc/32em64t-2n8c2t-pci-normalio.xml") + "): cores 8-11,24-27 | 12-15,28-31; GPUs 0,0"
    argv, _ = _launch_line(**slurm, TORCHHPC_LAUNCHER="srun")
    assert argv[-1] == "--cpu-bind=mask_cpu:0xf000f00,0xf000f000", argv
    fake = tmp_path / "bin"
    fake.mkdir()
    for flavor, version in (("pals", "mpiexec (PALS) 1.2"), ("hydra", "HYDRA build details:"),
                            ("openmpi", "mpiexec (Open MPI) 5.0.8")):
        (fake / "mpiexec").write_text(f"#!/bin/sh\necho '{version}'\n")
        (fake / "mpiexec").chmod(0o755)
        argv, _ = _launch_line(**slurm, TORCHHPC_LAUNCHER="mpiexec",
                               PATH=f"{fake}:{Path(sys.executable).parent}:/usr/bin:/bin")
        want = {"pals": ["-ppn", "2", "--cpu-bind", "list:8-11,24-27:12-15,28-31"],
                "hydra": ["-ppn", "2", "-bind-to", "user:8+9+10+11+24+25+26+27,12+13+14+15+28+29+30+31"],
                "openmpi": ["--map-by", "ppr:2:node", "--bind-to", "none", "-x", "TORCHHPC_CPU_MAP", "-x",
                            "TORCHHPC_GPU_MAP"]}[flavor]
        assert argv[3:] == want, (flavor, argv)
    shared = {**slurm, "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_CPUS_ON_NODE": "1"}  # a core of a node others share
    argv, bound = _launch_line(**shared, TORCHHPC_LAUNCHER="srun")
    assert argv[-3:] == ["1", "--cpu-bind=cores", "--export=ALL,OMPI_MCA_mpi_yield_when_idle=1"], argv
    assert bound == "BOUND 1 core(s) per rank", bound
