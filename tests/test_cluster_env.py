"""config_env.sh, the site profiles and the activation hook, exercised by sourcing them in clean shells.

Lmod's `module` and conda's activate.d mechanism are the boundaries we cannot run here: a shell function
records `module` calls, and the conda hook scripts are sourced the way conda sources them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITES = sorted(p.stem for p in (ROOT / "utils" / "sites").glob("*.sh"))


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A near-empty environment, like a fresh login shell without any module loaded."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C"}
    env.update(extra)
    return env


def bash(script: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `script` in a clean, non-interactive bash (no rc files) from the repository root."""
    proc = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", script],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def parse_vars(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        if "=" in line:
            key, _, value = line.partition("=")
            out[key] = value
    return out


# A stand-in for Lmod's `module`: records each call so the test sees what would be loaded.
FAKE_MODULE = 'module() { printf "module %s\\n" "$*" >> "$HOME/module.log"; }\n'
SHOW = (
    "for v in TORCHHPC_SITE TORCHHPC_SITE_PROFILE USE_MPI USE_CUDA USE_CUDNN USE_SYSTEM_NCCL USE_DISTRIBUTED "
    "NCCL_ROOT NCCL_LIB_DIR NCCL_INCLUDE_DIR MAX_JOBS BLAS CMAKE_PREFIX_PATH TORCH_CUDA_ARCH_LIST "
    "PYTORCH_BUILD_VERSION PYTORCH_VERSION TORCHVISION_VERSION TORCHHPC_PATCH_DIR CUDA_HOME CUDNN_LIB_DIR "
    "TORCHHPC_SUBMIT TORCHHPC_PBS_QUEUE TORCHHPC_PBS_SELECT_BUILD TORCHHPC_PBS_ACCOUNT TORCHHPC_ENV_PREFIX "
    "TORCHHPC_SITE_MODULES LDFLAGS; do echo \"$v=${!v-<unset>}\"; done\n"
)


def test_derecho_profile_sets_modules_build_variables_and_leaves_shell_options(tmp_path: Path) -> None:
    cuda = tmp_path / "cuda-12.2.1"
    cudnn = tmp_path / "cudnn-9.2"
    cuda.mkdir()
    cudnn.mkdir()
    env = clean_env(tmp_path, SITE="derecho", PYTORCH_VERSION="v2.5.1", TORCHHPC_NO_ENV="1",
                    TORCHHPC_PREFIX=str(tmp_path / "build"), NCAR_ROOT_CUDA=str(cuda),
                    NCAR_ROOT_CUDNN=str(cudnn), MAX_JOBS="12")
    script = FAKE_MODULE + (
        'before="$-"; source ./config_env.sh; echo "rc=$?"\n'
        'echo "opts_same=$([[ $- == "$before" ]] && echo 1)"\n'
        'echo "leaked_site_vars=$(compgen -v SITE_ | tr "\\n" " ")"\n'
        'echo "leaked_functions=$(declare -F | grep -cE "site_(matches|configure|runtime_env)")"\n'
    ) + SHOW
    out = parse_vars(bash(script, env).stdout)
    assert out["rc"] == "0"
    assert out["opts_same"] == "1", "sourcing changed the caller's shell options"
    assert out["leaked_site_vars"].strip() == "" and out["leaked_functions"] == "0"
    assert out["TORCHHPC_SITE"] == "derecho"
    assert out["TORCHHPC_SITE_PROFILE"] == str(ROOT / "utils/sites/derecho.sh")
    log = (tmp_path / "module.log").read_text().splitlines()
    assert log[0] == "module --force purge"
    loaded = log[1].split()[2:]
    assert loaded[:5] == ["ncarenv/23.09", "gcc/12.2.0", "ncarcompilers", "cray-mpich/8.1.27", "cuda/12.2.1"]
    assert any(m.startswith("cudnn/") for m in loaded) and "conda/latest" in loaded
    assert out["TORCHHPC_SITE_MODULES"] == " ".join(loaded)
    nccl = tmp_path / "build/opt/nccl-2.21.5-ofi-derecho"
    assert (out["USE_MPI"], out["USE_DISTRIBUTED"], out["USE_CUDA"], out["USE_CUDNN"]) == ("1", "1", "1", "1")
    assert out["USE_SYSTEM_NCCL"] == "1"
    assert (out["NCCL_ROOT"], out["NCCL_LIB_DIR"], out["NCCL_INCLUDE_DIR"]) == (
        str(nccl), f"{nccl}/lib", f"{nccl}/include")
    assert out["CUDA_HOME"] == str(cuda) and out["CUDNN_LIB_DIR"] == f"{cudnn}/lib"
    assert out["TORCH_CUDA_ARCH_LIST"] == "8.0" and out["BLAS"] == "MKL" and out["MAX_JOBS"] == "12"
    assert out["PYTORCH_VERSION"] == "2.5.1" and out["TORCHVISION_VERSION"] == "0.20.1"
    assert out["PYTORCH_BUILD_VERSION"] == "2.5.1+torchhpc.derecho"
    table_dir = subprocess.run(["utils/pytorch_version.sh", "2.5.1", "patches"], cwd=ROOT, capture_output=True,
                               text=True, timeout=30, check=True).stdout.strip()
    assert out["TORCHHPC_PATCH_DIR"] == str(ROOT / "patches/pytorch" / table_dir)
    env_prefix = str(tmp_path / "build/envs/torch-2.5.1-derecho")
    assert out["CMAKE_PREFIX_PATH"] == out["TORCHHPC_ENV_PREFIX"] == env_prefix
    assert (out["TORCHHPC_SUBMIT"], out["TORCHHPC_PBS_QUEUE"]) == ("qcmd", "main")
    assert "ngpus=4" in out["TORCHHPC_PBS_SELECT_BUILD"]


def test_sourcing_from_a_strict_script_works(tmp_path: Path) -> None:
    """Job scripts run under `set -euo pipefail`; sourcing (twice, with a venv) must survive that."""
    env = clean_env(tmp_path, SITE="generic", ENV_KIND="venv", TORCHHPC_QUIET="1",
                    TORCHHPC_PREFIX=str(tmp_path / "build"), TORCHHPC_VENV_ARGS="--without-pip")
    script = ("set -euo pipefail\nsource ./config_env.sh\nsource ./config_env.sh\n"
              'echo "opts=$-"; echo "venv=$VIRTUAL_ENV"\n')
    proc = bash(script, env)
    out = parse_vars(proc.stdout)
    assert "e" in out["opts"] and "u" in out["opts"], "the caller's own options must stay as they were"
    assert out["venv"] == str(tmp_path / f"build/envs/torch-{latest_version()}-generic")
    assert proc.stderr == ""


def latest_version() -> str:
    return subprocess.run(["utils/pytorch_version.sh", "--latest"], cwd=ROOT, capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()


def test_pbs_variables_override_site_defaults(tmp_path: Path) -> None:
    env = clean_env(tmp_path, SITE="derecho", TORCHHPC_NO_ENV="1", TORCHHPC_NO_MODULES="1",
                    PBS_QUEUE="develop", PBS_ACCOUNT="NTDD0001", PBS_SELECT_BUILD="1:ncpus=128")
    out = parse_vars(bash("source ./config_env.sh\n" + SHOW, env).stdout)
    assert (out["TORCHHPC_PBS_QUEUE"], out["TORCHHPC_PBS_ACCOUNT"]) == ("develop", "NTDD0001")
    assert out["TORCHHPC_PBS_SELECT_BUILD"] == "1:ncpus=128"


@pytest.mark.parametrize(("extra", "site"), [({"NCAR_HOST": "derecho"}, "derecho"), ({}, "generic")])
def test_site_is_detected_when_not_given(tmp_path: Path, extra: dict[str, str], site: str) -> None:
    env = clean_env(tmp_path, TORCHHPC_NO_ENV="1", TORCHHPC_NO_MODULES="1", **extra)
    out = parse_vars(bash("source ./config_env.sh\n" + SHOW, env).stdout)
    assert out["TORCHHPC_SITE"] == site
    assert out["TORCHHPC_SITE_PROFILE"] == str(ROOT / f"utils/sites/{site}.sh")


@pytest.mark.parametrize("has_cuda", [False, True])
def test_generic_profile_follows_cuda_home(tmp_path: Path, has_cuda: bool) -> None:
    cuda = tmp_path / "cuda"
    if has_cuda:
        cuda.mkdir()
    env = clean_env(tmp_path, SITE="generic", TORCHHPC_NO_ENV="1", CUDA_HOME=str(cuda))
    out = parse_vars(bash("source ./config_env.sh\n" + SHOW, env).stdout)
    want = "1" if has_cuda else "0"
    assert (out["USE_CUDA"], out["USE_SYSTEM_NCCL"], out["USE_MPI"]) == (want, want, "1")
    assert out["BLAS"] == "OpenBLAS"
    if has_cuda:
        assert out["CUDA_HOME"] == str(cuda)
    assert not (tmp_path / "module.log").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [({"SITE": "nosuchsite"}, "no site profile 'nosuchsite'"),
     ({"SITE": "generic", "PYTORCH_VERSION": "1.13.0"}, "PyTorch 1.13.0 is not supported")],
)
def test_bad_input_returns_an_error_and_keeps_the_shell(
    tmp_path: Path, extra: dict[str, str], message: str
) -> None:
    env = clean_env(tmp_path, TORCHHPC_NO_ENV="1", **extra)
    proc = bash('source ./config_env.sh; echo "rc=$?"; echo "alive opts=$-"', env)
    assert "rc=1" in proc.stdout and "alive" in proc.stdout and "e" not in proc.stdout.split("opts=")[1]
    assert message in proc.stderr
    if extra["SITE"] == "nosuchsite":
        assert all(s in proc.stderr for s in SITES)


def test_running_instead_of_sourcing_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "config_env.sh"], cwd=ROOT, env=clean_env(tmp_path), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and "must be sourced" in proc.stderr


def test_venv_sourced_twice_activates_hook_and_deactivate_restores(tmp_path: Path) -> None:
    env = clean_env(tmp_path, SITE="derecho", ENV_KIND="venv", TORCHHPC_QUIET="1", TORCHHPC_NO_MODULES="1",
                    TORCHHPC_PREFIX=str(tmp_path / "build"), TORCHHPC_VENV_ARGS="--without-pip",
                    FI_MR_CACHE_MONITOR="memhooks")
    script = (
        "source ./config_env.sh >/dev/null || exit 9; p1=$PATH\n"
        "source ./config_env.sh >/dev/null || exit 9\n"
        'echo "same_path=$([[ $PATH == "$p1" ]] && echo 1)"; echo "venv=$VIRTUAL_ENV"\n'
        'echo "NCCL_NET=$NCCL_NET"; echo "FI=$FI_MR_CACHE_MONITOR"; echo "GPU=$MPICH_GPU_SUPPORT_ENABLED"\n'
        'echo "LD=$LD_LIBRARY_PATH"\n'
        'echo "blocks=$(grep -c ">>> torchhpc site hook" "$VIRTUAL_ENV/bin/activate")"\n'
        'deactivate; echo "after_NCCL_NET=${NCCL_NET-<unset>}"; echo "after_FI=$FI_MR_CACHE_MONITOR"\n'
        'echo "after_LD=${LD_LIBRARY_PATH-<unset>}"; echo "after_venv=${VIRTUAL_ENV-<unset>}"\n'
    )
    out = parse_vars(bash(script, env).stdout)
    prefix = tmp_path / "build/envs"
    assert out["venv"].startswith(str(prefix)) and out["same_path"] == "1" and out["blocks"] == "1"
    assert (out["NCCL_NET"], out["FI"], out["GPU"]) == ("AWS Libfabric", "userfaultfd", "1")
    assert out["LD"].startswith(str(tmp_path / "build/opt/nccl-")) and out["LD"].endswith("/plugin/lib")
    assert out["after_NCCL_NET"] == "<unset>" and out["after_FI"] == "memhooks"
    assert out["after_LD"] == "<unset>" and out["after_venv"] == "<unset>"


def test_conda_hook_scripts_restore_under_posix_sh(tmp_path: Path) -> None:
    """conda sources activate.d/deactivate.d in the user's shell; check them under plain POSIX sh."""
    prefix = tmp_path / "condaenv"
    prefix.mkdir()
    env = clean_env(tmp_path, TORCHHPC_SITE="derecho", NCCL_OFI_PREFIX="/opt/nccl",
                    TORCHHPC_SITE_PROFILE=str(ROOT / "utils/sites/derecho.sh"))
    subprocess.run(["bash", "utils/write_activation_hook.sh", "conda", str(prefix)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=30)
    act = prefix / "etc/conda/activate.d/torchhpc.sh"
    deact = prefix / "etc/conda/deactivate.d/torchhpc.sh"
    script = (
        f'NCCL_SOCKET_IFNAME=eth0; export NCCL_SOCKET_IFNAME; . "{act}"; . "{act}"\n'
        'echo "on=$NCCL_SOCKET_IFNAME $NCCL_NET $TORCHHPC_SITE"\n'
        f'. "{deact}"; echo "off=$NCCL_SOCKET_IFNAME ${{NCCL_NET-unset}} ${{_TORCHHPC_OLD_NCCL_NET-gone}}"\n'
    )
    sh = shutil.which("dash") or "sh"
    proc = subprocess.run([sh, "-c", script], env=env, capture_output=True, text=True, timeout=30, check=True)
    out = parse_vars(proc.stdout)
    assert out["on"] == "hsn AWS Libfabric derecho"
    assert out["off"] == "eth0 unset gone"


@pytest.mark.parametrize("site", SITES)
def test_profile_defines_the_contract(site: str, tmp_path: Path) -> None:
    names = "SITE_DESCRIPTION SITE_ENV_KIND SITE_SUBMIT SITE_GPUS_PER_NODE"
    pbs = "SITE_PBS_QUEUE SITE_PBS_SELECT_BUILD SITE_PBS_WALLTIME_BUILD SITE_PBS_SELECT_TEST SITE_PBS_WALLTIME_TEST"
    slurm = "SITE_SLURM_CPUS_BUILD SITE_SLURM_TIME_BUILD SITE_SLURM_CPUS_TEST SITE_SLURM_TIME_TEST SITE_SRUN_MPI"
    script = (
        f"source utils/sites/{site}.sh\n"
        "declare -F site_matches site_configure site_runtime_env >/dev/null || exit 1\n"
        "declare -p SITE_MODULES >/dev/null || exit 1\n"
        f'names="{names}"; [[ $SITE_SCHEDULER == slurm ]] || names+=" {pbs}"\n'
        f'[[ $SITE_SCHEDULER == pbs ]] || [[ $SITE_SCHEDULER == auto && -z $SITE_SLURM_CPUS_TEST ]] '
        f'|| names+=" {slurm}"\n'
        'for v in $names; do [[ -n "${!v:-}" ]] || { echo "missing $v"; exit 1; }; done\n'
        '[[ $SITE_ENV_KIND == conda || $SITE_ENV_KIND == venv ]] || exit 1\n'
        '[[ $SITE_SUBMIT == qcmd || $SITE_SUBMIT == qsub ]] || exit 1\n'
        "NCCL_OFI_PREFIX=/x site_runtime_env\n"
    )
    body = bash(script, clean_env(tmp_path)).stdout.splitlines()
    # Documented line by line: every export/unset follows a comment line.
    for i, line in enumerate(body):
        if line.startswith(("export ", "unset ")):
            assert i > 0 and body[i - 1].startswith("#"), f"{site}: undocumented runtime line {line!r}"


def test_derecho_runtime_settings_cover_slingshot_and_nccl(tmp_path: Path) -> None:
    script = "source utils/sites/derecho.sh; NCCL_OFI_PREFIX=/x site_runtime_env"
    body = bash(script, clean_env(tmp_path)).stdout
    for needed in ('MPICH_GPU_SUPPORT_ENABLED=1', 'MPICH_OFI_NIC_POLICY=GPU',
                   'FI_MR_CACHE_MONITOR=userfaultfd', 'FI_CXI_DISABLE_HOST_REGISTER=1',
                   'NCCL_NET="AWS Libfabric"', 'NCCL_SOCKET_IFNAME=hsn',
                   'NCCL_CROSS_NIC=1', 'NCCL_NET_GDR_LEVEL=PHB'):
        assert f"export {needed}\n" in body


def test_version_table_lookup(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    run = lambda *a: subprocess.run(["utils/pytorch_version.sh", *a], cwd=ROOT, env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=30)
    assert run("v2.5.1", "torchvision").stdout.strip() == "0.20.1"
    assert run("2.4.1", "patches").stdout.strip() == "v2.4-v2.13"
    assert run("2.13.0", "commit").stdout.strip() == "cf30153c4c131c8164ee7798e5022d810682e2cb"
    versions = run("--list").stdout.split()
    assert run("--latest").stdout.strip() == versions[-1] and len(versions) >= 3
    bad = run("9.9.9", "cuda")
    assert bad.returncode == 1 and "not supported" in bad.stderr and all(v in bad.stderr for v in versions)
    assert run("2.5.1", "nonsense").returncode == 1

# shellcheck over config_env.sh and utils/**/*.sh (profiles and lib included) is tests/test_lint.py.
