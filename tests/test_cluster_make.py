"""The cluster Makefile targets: `make -n` and DRY_RUN=1 output, PBS job scripts, and a real (local) run
of the PyTorch build up to the patched source tree, with its stamps.

PBS (qsub/qcmd), Lmod and the network are boundaries: their commands are checked as printed by DRY_RUN=1;
the clone/patch/stamp steps run for real against a local git repository holding upstream's
ProcessGroupMPI.cpp excerpt, tagged like PyTorch.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _upstream import PG_MPI, tagged_upstream

ROOT = Path(__file__).resolve().parents[1]
USER = pwd.getpwuid(os.geteuid()).pw_name  # job scripts go to build/jobs/<user>
CLUSTER_TARGETS = ["cluster-versions", "build-pytorch-v%", "build-pytorch-v%-pbs", "nccl-ofi", "spack-env",
                   "spack-install", "install-packages", "test-pbs", "clean-pytorch", "clean-pytorch-v%",
                   "clean-nccl-ofi", "clean-cluster-envs", "clean-cluster"]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


def make(tmp_path: Path, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    """Run make in the repository root from a clean environment (no modules, no site, no conda)."""
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C",
            "TORCHHPC_PREFIX": str(tmp_path / "build")}
    proc = subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, env={**base, **env},
                          capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"make {' '.join(args)}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_help_lists_every_cluster_target_once(tmp_path: Path) -> None:
    out = make(tmp_path, "help").stdout
    for target in CLUSTER_TARGETS:
        lines = [line for line in out.splitlines() if line.split() and line.split()[0] == target]
        assert len(lines) == 1, f"{target} missing from make help"
        assert len(lines[0].split(None, 1)[1]) > 10, f"{target} has no help text"


def test_versions_come_from_the_table(tmp_path: Path) -> None:
    out = make(tmp_path, "cluster-versions").stdout.split("\n")
    assert out[0].split()[:3] == ["torch", "torchvision", "cuda"]
    assert any(line.split()[:2] == ["2.5.1", "0.20.1"] for line in out[1:] if line)


def test_make_n_pbs_and_slurm_builds_show_submission(tmp_path: Path) -> None:
    for scheduler in ("pbs", "slurm"):
        out = make(tmp_path, "-n", f"build-pytorch-v2.5.1-{scheduler}", "SITE=derecho").stdout
        flat = re.sub(r"\\\n\s*", "", out)
        submit = (f'PYTORCH_VERSION="2.5.1" bash utils/submit_job.sh --scheduler {scheduler} '
                  '--name "torchhpc-build-v2.5.1" --shape build')
        assert submit in flat
        assert "-- make build-pytorch-v2.5.1 SITE=\"derecho\"" in flat


def test_make_n_local_build_builds_nccl_then_pytorch(tmp_path: Path) -> None:
    lines = make(tmp_path, "-n", "build-pytorch-v2.4.1").stdout.splitlines()
    scripts = [line.split()[-1] for line in lines]
    assert scripts == ["utils/build_nccl-ofi-plugin.sh", "utils/build_pytorch.sh"]
    assert all('PYTORCH_VERSION="2.4.1"' in line for line in lines)


def job_and_submit(stdout: str) -> tuple[list[str], str]:
    script, _, submit = stdout.partition("# submit command:\n")
    return script.splitlines(), submit.strip()


def test_derecho_pbs_build_dry_run_prints_job_script_and_qcmd(tmp_path: Path) -> None:
    out = make(tmp_path, "build-pytorch-v2.5.1-pbs", "SITE=derecho", "DRY_RUN=1",
               PBS_ACCOUNT="NTDD0001").stdout
    script, submit = job_and_submit(out)
    assert script[1] == "#!/bin/bash -l"
    for directive in ("#PBS -N torchhpc-build-v2.5.1", "#PBS -A NTDD0001", "#PBS -q main",
                      "#PBS -l select=1:ncpus=64:mpiprocs=1:ngpus=4", "#PBS -l walltime=04:00:00"):
        assert directive in script
    assert "set -euo pipefail" in script
    assert f"export SITE=derecho PYTORCH_VERSION=2.5.1 TORCHHPC_PREFIX={tmp_path}/build SCHEDULER=pbs" in script
    assert script[-1] == f"make build-pytorch-v2.5.1 SITE=derecho TORCHHPC_PREFIX={tmp_path}/build"
    job = f"{tmp_path}/build/jobs/{USER}/torchhpc-build-v2.5.1.pbs"
    assert submit == ("qcmd -N torchhpc-build-v2.5.1 -q main -l select=1:ncpus=64:mpiprocs=1:ngpus=4 "
                      f"-l walltime=04:00:00 -A NTDD0001 -l job_priority=regular -- bash -l {job}")
    assert not Path(job).exists(), "a dry run must not write the job script"


def test_generic_pbs_dry_run_uses_blocking_qsub_and_overrides(tmp_path: Path) -> None:
    out = make(tmp_path, "build-pytorch-v2.6.0-pbs", "SITE=generic", "DRY_RUN=1", PBS_QUEUE="gpu",
               PBS_WALLTIME_BUILD="06:00:00", PBS_SELECT_BUILD="1:ncpus=96").stdout
    script, submit = job_and_submit(out)
    assert "#PBS -q gpu" in script and "#PBS -l walltime=06:00:00" in script
    assert "#PBS -l select=1:ncpus=96" in script and not any(s.startswith("#PBS -A") for s in script)
    assert submit == f"qsub {tmp_path}/build/jobs/{USER}/torchhpc-build-v2.6.0.pbs"


def test_real_submission_without_account_or_qsub_fails_clearly(tmp_path: Path) -> None:
    proc = make(tmp_path, "build-pytorch-v2.5.1-pbs", "SITE=derecho", check=False)
    assert proc.returncode != 0 and "needs a project account" in proc.stderr
    proc = make(tmp_path, "build-pytorch-v2.5.1-pbs", "SITE=generic", check=False)
    assert proc.returncode != 0 and "'qsub' not found" in proc.stderr


def test_bad_resources_are_rejected(tmp_path: Path) -> None:
    proc = make(tmp_path, "test-pbs", "SITE=generic", "DRY_RUN=1", PBS_WALLTIME_TEST="20min", check=False)
    assert proc.returncode != 0 and "is not HH:MM:SS" in proc.stderr


def test_derecho_build_dry_run_shows_modules_variables_and_patch_order(tmp_path: Path) -> None:
    cuda = tmp_path / "cuda"
    cuda.mkdir()
    proc = make(tmp_path, "build-pytorch-v2.5.1", "SITE=derecho", "DRY_RUN=1", NCAR_ROOT_CUDA=str(cuda))
    out = proc.stdout
    assert "TORCHHPC_SITE_MODULES=ncarenv/23.09 gcc/12.2.0 ncarcompilers cray-mpich/8.1.27 cuda/12.2.1" in out
    for setting in ("USE_CUDA=1", "USE_MPI=1", "USE_DISTRIBUTED=1", "USE_SYSTEM_NCCL=1", "BLAS=MKL",
                    "TORCH_CUDA_ARCH_LIST=8.0", "PYTORCH_BUILD_VERSION=2.5.1+torchhpc.derecho", "MAX_JOBS=64",
                    f"NCCL_ROOT={tmp_path}/build/opt/nccl-2.21.5-ofi-derecho"):
        assert f"\n{setting}\n" in out, setting
    commands = [line[2:] for line in out.splitlines() if line.startswith("+ ")]
    # NCCL + plugin first, pinned, for A100 and against Cray's libfabric.
    nccl_clone = next(i for i, c in enumerate(commands) if "nccl.git" in c)
    assert "--branch v2.21.5-1" in commands[nccl_clone]
    assert any("NVCC_GENCODE=-gencode=arch=compute_80\\,code=sm_80" in c for c in commands)
    configure = next(c for c in commands if "./configure" in c)
    assert "--with-libfabric=/opt/cray/libfabric/1.15.2.0" in configure and f"--with-cuda={cuda}" in configure
    assert "-Wl\\,-rpath\\,/opt/cray/libfabric/1.15.2.0/lib64" in configure
    # Then PyTorch: clone at the tag, every patch in file-name order (checked, then applied), submodules.
    patch_dir = subprocess.run(["utils/pytorch_version.sh", "2.5.1", "patches"], cwd=ROOT, capture_output=True,
                               text=True, timeout=30, check=True).stdout.strip()
    patches = sorted((ROOT / "patches/pytorch" / patch_dir).glob("*.patch"))
    torch_clone = next(i for i, c in enumerate(commands) if "pytorch.git" in c)
    assert torch_clone > nccl_clone and "--branch v2.5.1" in commands[torch_clone]
    applied = [c.split()[-1] for c in commands if "git apply" in c]
    assert applied == [str(p) for p in patches for _ in (0, 1)]
    first_submodule = next(i for i, c in enumerate(commands) if "git submodule update" in c)
    last_apply = max(i for i, c in enumerate(commands) if "git apply" in c)
    assert torch_clone < last_apply < first_submodule
    assert any("requirements.txt mkl-static mkl-include" in c for c in commands)
    wheel = f"setup.py bdist_wheel --dist-dir {tmp_path}/build/wheels/derecho"
    assert any(c.endswith(wheel) for c in commands)
    assert any(c.endswith("torch==2.5.1+torchhpc.derecho") for c in commands)
    assert any("--branch v0.20.1" in c and "vision.git" in c for c in commands)
    assert commands[-1].endswith("--torchvision-version 0.20.1+torchhpc.derecho --cuda 1")


def test_unsupported_version_fails_with_the_supported_list(tmp_path: Path) -> None:
    proc = make(tmp_path, "build-pytorch-v9.9.9", "DRY_RUN=1", check=False)
    assert proc.returncode != 0 and "PyTorch 9.9.9 is not supported" in proc.stderr and "2.5.1" in proc.stderr


def test_test_pbs_dry_run_two_gpu_nodes_three_backends(tmp_path: Path) -> None:
    out = make(tmp_path, "test-pbs", "SITE=derecho", "DRY_RUN=1", PBS_ACCOUNT="NTDD0001").stdout
    script, submit = job_and_submit(out)
    assert "#PBS -l select=2:ncpus=64:mpiprocs=4:ngpus=4" in script and "#PBS -l walltime=00:20:00" in script
    assert script[-1] == ("env ALL_REDUCE_TEST=tests/all_reduce_test.py BACKENDS=nccl\\,mpi\\,accl "
                          "bash utils/run_all_reduce.sh")
    assert submit.startswith("qcmd -N torchhpc-test-all-reduce -q main -l select=2:")
    # What that job runs: one mpiexec per backend, 2 nodes x 4 GPUs.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SITE": "derecho", "DRY_RUN": "1",
           "TORCHHPC_NO_MODULES": "1"}
    runner = subprocess.run(["bash", "utils/run_all_reduce.sh"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env=env)
    assert runner.returncode == 0, runner.stderr
    lines = [line for line in runner.stdout.splitlines() if line.startswith("+ mpiexec")]
    assert [line.split()[-1] for line in lines] == ["nccl", "mpi", "accl"]
    assert all(" -n 8 -ppn 4 " in line for line in lines)


def test_nccl_ofi_without_cuda_is_skipped_with_a_message(tmp_path: Path) -> None:
    out = make(tmp_path, "nccl-ofi", "SITE=generic", "DRY_RUN=1", CUDA_HOME=str(tmp_path / "none")).stdout
    assert "USE_CUDA=0" in out and "NCCL is not built" in out


def test_install_packages_dry_run_builds_mpi4py_against_site_mpi(tmp_path: Path) -> None:
    out = make(tmp_path, "install-packages", "SITE=generic", "DRY_RUN=1", MPICC="/opt/mpi/bin/mpicc").stdout
    assert "+ env MPICC=/opt/mpi/bin/mpicc python -m pip install --no-binary mpi4py" in out
    assert f"+ python -m pip install {ROOT}" in out


def test_spack_targets(tmp_path: Path) -> None:
    # A Spack named by the user (SPACK=..., or `spack` on PATH) is used as it is, with a warning when it is not
    # the pinned one.
    spack = "/opt/spack/bin/spack"
    out = make(tmp_path, "spack-env", "SITE=derecho", "DRY_RUN=1", SPACK=spack)
    assert f"+ cp {ROOT}/utils/sites/derecho.spack.yaml {ROOT}/build/spack-site.yaml" in out.stdout
    assert f"+ {spack} -e {ROOT} concretize --force --fresh" in out.stdout
    assert "torchhpc is tested with Spack 1.2.0.dev0" in out.stderr
    out = make(tmp_path, "spack-install", "SITE=generic", "DRY_RUN=1", SPACK=spack).stdout
    assert f"+ cp {ROOT}/utils/sites/generic.spack.yaml {ROOT}/build/spack-site.yaml" in out
    concretize = out.index(f"+ {spack} -e {ROOT} concretize")
    assert out.index(f"+ {spack} -e {ROOT} install --fail-fast") > concretize
    # Without one, the pinned commits of utils/spack_pins.tsv are set up under TORCHHPC_PREFIX: cloned ...
    prefix = tmp_path / "build" / "spack"
    out = make(tmp_path, "spack-env", "SITE=generic", "DRY_RUN=1").stdout
    assert f"+ git -C {prefix}/spack checkout --quiet 9cf66332df3dd988248617fc93400045be59ebab" in out
    assert f"+ git -C {prefix}/spack-packages checkout --quiet 1e8cf059e35d55c4fe1142fed41785bedf6c7246" in out
    assert f"+ {prefix}/spack/bin/spack -e {ROOT} concretize --force --fresh" in out
    # ... or unpacked from SPACK_ARCHIVES, offline; a missing archive is named.
    out = make(tmp_path, "spack-env", "SITE=generic", "DRY_RUN=1", SPACK_ARCHIVES="/srv/vendor").stdout
    assert f"+ tar xzf /srv/vendor/spack-9cf66332df3d.tar.gz -C {prefix}/spack --strip-components=1" in out
    proc = make(tmp_path, "spack-env", "SITE=generic", check=False, SPACK_ARCHIVES=str(tmp_path))
    assert proc.returncode != 0 and "has no spack-9cf66332df3d.tar.gz" in proc.stderr


def test_clean_targets_only_touch_the_build_prefix(tmp_path: Path) -> None:
    for target in ("clean-pytorch", "clean-pytorch-v2.5.1", "clean-nccl-ofi", "clean-cluster-envs",
                   "clean-cluster"):
        for line in make(tmp_path, "-n", target).stdout.splitlines():
            paths = re.findall(r'"([^"]+)"', line)
            assert paths and all(p.startswith(f"{tmp_path}/build") for p in paths), line


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_local_build_clones_patches_and_skips_finished_steps(tmp_path: Path) -> None:
    """A real run up to the patched tree: clone from a local 'upstream' tag, git apply, stamps, re-run."""
    upstream = tagged_upstream(tmp_path / "upstream", "v2.5.1")
    env = {"PYTORCH_GIT": f"file://{upstream}", "CUDA_HOME": str(tmp_path / "nocuda"), "ENV_KIND": "venv",
           "TORCHHPC_VENV_ARGS": "--without-pip", "STOP_AFTER": "patches"}
    first = make(tmp_path, "build-pytorch-v2.5.1", "SITE=generic", **env)
    src = tmp_path / "build/src/pytorch-v2.5.1"
    patched = (src / PG_MPI).read_text()
    assert "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA" in patched
    assert "STOP_AFTER=patches: stopping here" in first.stdout
    stamps = tmp_path / "build/stamps"
    assert (stamps / "pytorch-v2.5.1.clone").read_text().strip() == "v2.5.1"
    assert (tmp_path / "build/envs/torch-2.5.1-generic/etc/torchhpc/activate.sh").is_file()

    second = make(tmp_path, "build-pytorch-v2.5.1", "SITE=generic", **env)
    assert "already cloned" in second.stdout and "already applied" in second.stdout
    assert (src / PG_MPI).read_text() == patched

    (stamps / "pytorch-v2.5.1.patches").write_text("an older patch set\n")
    third = make(tmp_path, "build-pytorch-v2.5.1", "SITE=generic", check=False, **env)
    assert third.returncode != 0 and "make clean-pytorch-v2.5.1" in third.stderr

    make(tmp_path, "clean-pytorch-v2.5.1")
    assert not src.exists() and not list(stamps.glob("pytorch-v2.5.1.*"))
