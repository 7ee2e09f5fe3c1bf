"""Safe on a shared node: what another user (a second unprivileged uid, ``setpriv``) plants in shared places
neither runs as the user, nor is read as the user's, nor stops the user's jobs; what torchhpc keeps is private.
docs/security.md is the threat model these tests check."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from _stranger import ROOT, STRANGER, VICTIM, needs_two_users, run_as, shared_dir


def _own(path: Path, uid: int, mode: int) -> Path:
    """``path`` (a new directory if missing) given to ``uid`` with ``mode``."""
    if not path.exists():
        path.mkdir()
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


@needs_two_users
def test_private_dirs_refuse_a_name_another_user_took_first() -> None:
    tmp = shared_dir()
    taken = _own(tmp / f"torchhpc-{VICTIM}", STRANGER, 0o777)
    (tmp / "elsewhere").mkdir()
    code = """
        from torchhpc.runtime import private
        try:
            private.runtime_dir("flight")
        except private.UnsafePathError as exc:
            print("REFUSED", exc)
    """
    out = run_as(VICTIM, code, {"TMPDIR": str(tmp)})
    assert "REFUSED" in out.stdout and f"owned by uid {STRANGER}" in out.stdout, out.stdout + out.stderr
    taken.rmdir()
    os.symlink(tmp / "elsewhere", tmp / f"torchhpc-{VICTIM}")
    out = run_as(VICTIM, code, {"TMPDIR": str(tmp)})
    assert "REFUSED" in out.stdout and "symbolic link" in out.stdout, out.stdout + out.stderr
    (tmp / f"torchhpc-{VICTIM}").unlink()
    out = run_as(VICTIM, code.replace('print("REFUSED", exc)', 'raise').replace(
        'private.runtime_dir("flight")', 'd = private.runtime_dir("flight"); print("MODE", oct(d.stat().st_mode))'),
        {"TMPDIR": str(tmp)})
    assert "MODE 0o40700" in out.stdout, out.stdout + out.stderr


@needs_two_users
def test_the_mpi_backend_build_keeps_its_download_in_the_users_own_cache() -> None:
    tmp = shared_dir()
    planted = _own(tmp / "torchhpc-mpi-backend", STRANGER, 0o777)
    out = run_as(VICTIM, f"from pathlib import Path; from torchhpc.mpi_upstream import build; "
                 f"d = build.default_workdir(Path({str(tmp)!r})); print('DIR', d, oct(d.stat().st_mode))",
                 {"TMPDIR": str(tmp)})
    assert out.returncode == 0, out.stderr
    chosen, mode = out.stdout.split("DIR ", 1)[1].split()
    assert Path(chosen) != planted and tmp not in Path(chosen).parents and mode == "0o40700"


def _accl_built() -> bool:
    from torchhpc.accl import core

    try:
        return bool(core.load_backend().flight_recorder_built())
    except Exception:  # noqa: BLE001  (not built: the accl suites say why)
        return False


@needs_two_users
def test_flight_dumps_go_to_a_private_directory_and_never_through_a_planted_link() -> None:
    """torch's default dump path is a fixed name in /tmp, and its writer follows a symlink: a stranger's link there
    (or in any directory others can write) made the user's dump overwrite a file of the stranger's choosing."""
    if not _accl_built():
        pytest.fail("accl's backend with the flight recorder is not built (make env, nlohmann-json3-dev)")
    tmp = shared_dir()
    victim_file = tmp / "victims-precious-file"
    victim_file.write_text("keep me\n")
    _own(victim_file, VICTIM, 0o600)
    os.symlink(victim_file, tmp / "nccl_trace_rank_0")  # what the stranger plants
    os.lchown(tmp / "nccl_trace_rank_0", STRANGER, STRANGER)
    code = """
        import os, warnings, torch, torch.distributed as dist, torchhpc.accl
        warnings.simplefilter("always")
        dist.init_process_group("accl", store=dist.HashStore(), rank=0, world_size=1)
        dist.all_reduce(torch.ones(4))
        path = torchhpc.accl.dump_flight_record()
        print("DUMP", path, oct(os.stat(os.path.dirname(path)).st_mode), os.path.getsize(path))
        dist.destroy_process_group()
    """
    for env in ({}, {"TORCH_FR_DUMP_TEMP_FILE": str(tmp / "nccl_trace_rank_")}):  # the default; a shared dir named
        out = run_as(VICTIM, code, {"TMPDIR": str(tmp), **env})
        assert out.returncode == 0, out.stderr
        path, dmode, size = out.stdout.split("DUMP ", 1)[1].split()
        assert Path(path).parent == tmp / f"torchhpc-{VICTIM}" / "flight" and dmode == "0o40700" and int(size) > 0
        assert victim_file.read_text() == "keep me\n"
        if env:
            assert "not writing flight records to TORCH_FR_DUMP_TEMP_FILE" in out.stderr, out.stderr


_EVIL = """
import pickle, sys
class Evil:
    def __reduce__(self):
        return (open, ({marker!r}, "w"))
with open(sys.argv[1], "wb") as f:
    pickle.dump(Evil(), f)
"""


@pytest.mark.parametrize("trust", [False, True])
@needs_two_users
def test_frtrace_refuses_dumps_another_user_could_have_written(trust: bool) -> None:
    """torch's loader unpickles every file under the directory: a stranger's file in a shared dump directory ran
    code as the user who ran `torchhpc frtrace`."""
    dumps = _own(shared_dir() / "dumps", VICTIM, 0o1777)  # the user's, left open to others (a scratch habit)
    marker = shared_dir() / "ran-as-victim"
    out = run_as(STRANGER, f"import sys; sys.argv = ['x', {str(dumps / 'nccl_trace_rank_1')!r}]; "
                 f"exec({_EVIL.format(marker=str(marker))!r})")
    assert out.returncode == 0, out.stderr
    code = f"import sys; from torchhpc import frtrace; sys.exit(frtrace.main([{str(dumps)!r}" + \
        (", '--trust-others'" if trust else "") + "]))"
    out = run_as(VICTIM, code)
    if trust:  # the override reads it, as torch would: the test can see the planted file act
        assert marker.exists(), out.stdout + out.stderr
    else:
        assert out.returncode == 2 and "refusing to read" in out.stderr and "--trust-others" in out.stderr
        assert "lets others write" in out.stderr, out.stderr
        assert not marker.exists()


@needs_two_users
def test_another_users_file_in_dev_shm_stops_no_chunktensor() -> None:
    """The reaper unlinked every torchhpc-cs.* whose owner looked dead and caught only FileNotFoundError:
    one empty file of another user's (EPERM) made every segment creation on the node fail."""
    shm = shared_dir()
    for name in ("torchhpc-cs.1.2.abc", f"torchhpc-cs.{VICTIM}.2.3.abc", f"torchhpc-cs.{STRANGER}.2.3.abc"):
        out = run_as(STRANGER, f"open({str(shm / name)!r}, 'w').close()")
        assert out.returncode == 0, out.stderr
    code = """
        import os
        from torchhpc.chunkstore.shm import Segment, reap_dead_segments
        s = Segment.create(1 << 16)
        print("MADE", s.path.name.split(".")[1] == str(os.geteuid()))
        s.close()
    """
    out = run_as(VICTIM, code, {"TORCHHPC_SHM_DIR": str(shm)})
    assert "MADE True" in out.stdout, out.stdout + out.stderr
    assert sorted(p.name for p in shm.iterdir()) == sorted(
        ["torchhpc-cs.1.2.abc", f"torchhpc-cs.{VICTIM}.2.3.abc", f"torchhpc-cs.{STRANGER}.2.3.abc"])
    # the user's own segment of a dead process is reaped, as before
    (shm / f"torchhpc-cs.{VICTIM}.999999.1.ab").touch()
    os.chown(shm / f"torchhpc-cs.{VICTIM}.999999.1.ab", VICTIM, VICTIM)
    out = run_as(VICTIM, code, {"TORCHHPC_SHM_DIR": str(shm)})
    assert "MADE True" in out.stdout and not (shm / f"torchhpc-cs.{VICTIM}.999999.1.ab").exists()


@needs_two_users
def test_checkpoints_are_private_and_a_planted_step_is_neither_found_nor_loaded() -> None:
    root = shared_dir()
    code = f"""
        import os, torch, torch.distributed as dist
        from torchhpc import checkpoint
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        m = torch.nn.Linear(2, 2)
        path = checkpoint.save({{"model": m}}, {str(root)!r}, 7)
        modes = {{oct(os.stat(os.path.join(d, f)).st_mode & 0o777) for d, _, fs in os.walk(path) for f in fs}}
        print("SAVED", oct(path.stat().st_mode & 0o777), sorted(modes))
        print("LATEST", checkpoint.latest({str(root)!r}))
        try:
            checkpoint.load({{"model": m}}, {str(root / 'step-99999999')!r})
        except checkpoint.CheckpointError as exc:
            print("REFUSED", exc)
        dist.destroy_process_group()
    """
    marker = shared_dir() / "ran"
    planted = root / "step-99999999"
    out = run_as(STRANGER, f"import os; os.mkdir({str(planted)!r}, 0o755); import sys; "
                 f"sys.argv = ['x', {str(planted / '.metadata')!r}]; exec({_EVIL.format(marker=str(marker))!r})")
    assert out.returncode == 0, out.stderr
    out = run_as(VICTIM, code)
    assert "SAVED 0o700 ['0o600']" in out.stdout, out.stdout + out.stderr
    assert f"LATEST {root}/step-00000007" in out.stdout, out.stdout + out.stderr
    assert "REFUSED" in out.stdout and f"owned by uid {STRANGER}" in out.stdout
    assert not marker.exists()


@needs_two_users
def test_jobscript_never_runs_a_checkout_found_above_the_current_directory() -> None:
    """Run from under a world-writable directory, `torchhpc jobscript` looked for a checkout in every parent and
    ran the first one's utils/submit_job.sh: a stranger's script, as the user."""
    scratch = shared_dir()
    marker = shared_dir() / "ran-as-victim"
    out = run_as(STRANGER, f"""
import os
root = {str(scratch)!r}
for d in ("utils", "work"):
    os.makedirs(os.path.join(root, d), exist_ok=True)
os.chmod(os.path.join(root, "work"), 0o777)
for f in ("config_env.sh", "utils/run_ranks.sh"):
    open(os.path.join(root, f), "w").close()
with open(os.path.join(root, "utils/submit_job.sh"), "w") as f:
    f.write("touch {marker}\\n")
""")
    assert out.returncode == 0, out.stderr
    code = f"""
        import os, sys
        os.chdir({str(scratch / 'work')!r})
        from torchhpc import jobscript
        sys.exit(jobscript.main(["--scheduler", "slurm", "--", "python", "train.py"]))
    """
    out = run_as(VICTIM, code, {"SITE": "generic", "TORCHHPC_PREFIX": str(shared_dir() / "victim")})
    assert not marker.exists(), "a stranger's submit_job.sh ran as the user"
    # naming a checkout that others can write is refused too
    out = run_as(VICTIM, code.replace('["--scheduler"', f'["--checkout", {str(scratch)!r}, "--scheduler"'),
                 {"SITE": "generic"})
    assert out.returncode != 0 and "refusing the checkout" in out.stderr, out.stdout + out.stderr
    assert not marker.exists()


def test_a_working_directory_name_cannot_add_lines_to_the_job_script(tmp_path: Path) -> None:
    work = tmp_path / "x\ntouch /tmp/pwned-by-dirname\n"
    work.mkdir(parents=True)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C",
           "TORCHHPC_PREFIX": str(tmp_path / "build"), "SITE": "generic", "TORCHHPC_ROOT": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torchhpc", "jobscript", "--scheduler", "slurm", "--", "true"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "touch /tmp/pwned-by-dirname" not in proc.stdout.splitlines(), proc.stdout
    trace = subprocess.run(["bash", "-n", "-c", proc.stdout], capture_output=True, text=True)
    assert trace.returncode == 0, trace.stderr


@needs_two_users
def test_job_logs_and_records_are_the_users_own(tmp_path: Path) -> None:
    shared_prefix = shared_dir()
    code = f"""
        import subprocess, sys
        proc = subprocess.run(["bash", {str(ROOT / 'utils/submit_job.sh')!r}, "--name", "j", "--scheduler", "pbs",
                               "--shape", "test", "--print-script", "--", "true"], capture_output=True, text=True)
        print(proc.stdout)
        print(proc.stderr, file=sys.stderr)
    """
    out = run_as(VICTIM, code, {"TORCHHPC_PREFIX": str(shared_prefix), "SITE": "generic", "DRY_RUN": "1"})
    lines = out.stdout.splitlines()
    exec_line = next((line for line in lines if line.startswith("exec >>")), "")
    assert '-"${PBS_JOBID}".log' in exec_line, out.stdout + out.stderr  # one log per job id
    folder = Path(exec_line.split(">>", 1)[1].split('"', 1)[0]).parent
    assert folder.parent == shared_prefix / "jobs" and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert folder.stat().st_uid == VICTIM
    # a job folder another user made for us is refused
    other = shared_dir()
    (other / "jobs").mkdir(mode=0o777)
    (other / "jobs").chmod(0o777)
    made = run_as(STRANGER, f"import os; os.mkdir({str(other / 'jobs' / 'victim')!r}, 0o777)")
    assert made.returncode == 0, made.stderr
    out = run_as(VICTIM, code, {"TORCHHPC_PREFIX": str(other), "SITE": "generic", "DRY_RUN": "1",
                                "TORCHHPC_JOBS_DIR": str(other / "jobs" / "victim")})
    assert "exec >>" not in out.stdout and f"owned by uid {STRANGER}" in out.stderr, out.stdout + out.stderr
    # --attach sources a job's record: one planted in a folder another user owns is never read
    made = run_as(STRANGER, f"open({str(other / 'jobs' / 'victim' / 'j.job')!r}, 'w').write('touch {other}/ran\\n')")
    assert made.returncode == 0, made.stderr
    attach = f"""
        import subprocess, sys
        proc = subprocess.run(["bash", {str(ROOT / 'utils/submit_job.sh')!r}, "--attach", "j"], capture_output=True,
                              text=True)
        print(proc.stderr, file=sys.stderr)
    """
    out = run_as(VICTIM, attach, {"TORCHHPC_PREFIX": str(other), "SITE": "generic",
                                  "TORCHHPC_JOBS_DIR": str(other / "jobs" / "victim")})
    assert f"owned by uid {STRANGER}" in out.stderr and not (other / "ran").exists(), out.stderr


@pytest.mark.parametrize("value", ["", "/", "//"])
def test_make_refuses_an_empty_or_root_prefix_for_every_removal(value: str) -> None:
    for var, target in (("TORCHHPC_PREFIX", "clean-nccl-ofi"), ("TORCHHPC_PREFIX", "clean-cluster"),
                        ("VENV", "clean-env"), ("NATIVE_PREFIX", "clean-native")):
        proc = subprocess.run(["make", "-n", target], cwd=ROOT, env={**os.environ, var: value},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and f"{var}='{value}' is empty or /" in proc.stderr, proc.stdout
        assert "rm -rf" not in proc.stdout


def test_a_process_run_without_mpiexec_leaves_no_open_mpi_segment() -> None:
    """Open MPI 5 singletons never remove their 16 MiB segment in /dev/shm, after an exit or a kill; accl's
    load unlinks it once mapped."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    code = ("import os, signal, sys; sys.path.insert(0, {!r}); from torchhpc.accl import core; core.load_backend(); "
            "from torchhpc.runtime import mpi_info; "
            "print('OPENMPI', 'Open MPI' in mpi_info.library_version(), flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL) if sys.argv[1] == 'kill' else None").format(str(ROOT / "src"))
    for how in ("exit", "kill"):
        before = {p.name for p in shm.glob("sm_segment.*")}
        proc = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))})
        if "OPENMPI False" in proc.stdout:
            pytest.skip("the MPI here is not Open MPI")
        assert "OPENMPI True" in proc.stdout, proc.stderr
        left = {p.name for p in shm.glob("sm_segment.*")} - before
        assert not left, f"{how}: a singleton left {sorted(left)}"
