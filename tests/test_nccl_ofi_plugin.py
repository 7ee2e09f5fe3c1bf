"""`make nccl-ofi` builds aws-ofi-nccl for real and `torchhpc doctor` shows NCCL would load it (no GPU needed).

Inputs: the plugin archives in ../shared/vendor (1.6.0, Derecho's pin, and 1.21.1), Debian's libfabric-dev
(1.17) and libhwloc-dev, and in place of a CUDA toolkit and a site NCCL the pinned nvidia-* wheels that
`make nccl-ofi-inputs` unpacks into .venv/nccl-ofi-inputs (CI runs it before `make test`).  Each is skipped
with a message where absent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torchhpc.runtime import nccl_plugin

ROOT = Path(__file__).resolve().parents[1]
VENDOR = ROOT.parent / "shared" / "vendor"
INPUTS = Path(sys.executable).parents[1] / "nccl-ofi-inputs"
FABRIC_H = Path("/usr/include/rdma/fabric.h")
STAND_IN_ROW = "2.6.0"  # the utils/pytorch_versions.tsv row whose NCCL (2.21.5) the pinned wheel provides

pytestmark = [
    pytest.mark.full("the OFI plugin built from its vendored archives"),
    pytest.mark.skipif(not (INPUTS / "cuda/include/cuda_runtime.h").exists(),
                       reason=f"no CUDA/NCCL wheels in {INPUTS}: run `make nccl-ofi-inputs`"),
    pytest.mark.skipif(not FABRIC_H.exists(), reason="libfabric headers missing: apt-get install libfabric-dev"),
    pytest.mark.skipif(shutil.which("autoreconf") is None or shutil.which("libtoolize") is None,
                       reason="autotools missing: apt-get install autoconf automake libtool"),
]


def archive(version: str) -> Path:
    path = VENDOR / f"aws-ofi-nccl-{version}.tar.gz"
    if not path.exists():
        pytest.skip(f"{path} absent (the vendored upstream archives are not on this machine)")
    return path


def make_nccl_ofi(prefix: Path, version: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(prefix), "LANG": "C",
           "SITE": "generic", "TORCHHPC_PREFIX": str(prefix), "PYTORCH_VERSION": STAND_IN_ROW,
           "CUDA_HOME": str(INPUTS / "cuda"),
           "NCCL_HOME": str(INPUTS / "nccl"), "AWS_OFI_NCCL_SOURCES": str(VENDOR),
           "AWS_OFI_NCCL_VERSION": version, "MAX_JOBS": str(os.cpu_count() or 2), **extra}
    return subprocess.run(["make", "--no-print-directory", "nccl-ofi"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module", params=["1.6.0", "1.21.1"])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The plugin built from the vendored archive; (version, the NCCL+plugin prefix)."""
    version = request.param
    archive(version)
    prefix = tmp_path_factory.mktemp(f"ofi-{version}")
    proc = make_nccl_ofi(prefix, version)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    opt = prefix / "opt/nccl-2.21.5-ofi-generic"
    assert (opt / "plugin/lib/libnccl-net.so").exists(), proc.stdout[-2000:]
    return version, opt


EXPECTED = {  # version: (symbols exported, the one NCCL 2.21.5 takes, its name with NCCL_NET unset)
    "1.6.0": (range(2, 7), 6, "AWS Libfabric"),
    "1.21.1": (range(6, 13), 8, "Libfabric"),
}


def doctor(opt: Path, **env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "OMPI_", "PMI", "SLURM_"))}
    base["LD_LIBRARY_PATH"] = f"{opt}/plugin/lib:{opt}/lib"
    proc = subprocess.run([sys.executable, "-m", "torchhpc", "doctor", "--json", "--no-probe"],
                          env={**base, **env}, capture_output=True, text=True, timeout=180)
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    assert checks["mpi"]["status"] == "OK", "probing the plugin must not disturb MPI in the doctor"
    return checks["nccl plugin"]


def test_plugin_exports_the_symbols_nccl_looks_for(built: tuple[str, Path]) -> None:
    version, opt = built
    exported, _, _ = EXPECTED[version]
    out = subprocess.run(["nm", "-D", "--defined-only", str(opt / "plugin/lib/libnccl-net.so")], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    symbols = {line.split()[-1] for line in out.splitlines() if "ncclNetPlugin_v" in line}
    assert symbols == {f"ncclNetPlugin_v{v}" for v in exported}
    ldd = subprocess.run(["ldd", str(opt / "plugin/lib/libnccl-net.so")], capture_output=True, text=True,
                         timeout=60).stdout
    assert "not found" not in ldd and "libfabric.so.1" in ldd


def test_doctor_shows_the_plugin_nccl_would_load(built: tuple[str, Path]) -> None:
    version, opt = built
    _, chosen, name = EXPECTED[version]
    check = doctor(opt)
    assert check["status"] == "OK", check
    assert f"{opt}/plugin/lib/libnccl-net.so: symbol ncclNetPlugin_v{chosen}, name '{name}'" in check["value"]
    assert "NCCL 2.21.5" in check["value"] and "asks for v8, v7, v6, v5" in check["value"]


def net_check(opt: Path, **env: str) -> dict[str, str]:
    """The doctor's check function alone (still probing the plugin in a child process), for each setting."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "OMPI_", "PMI", "SLURM_"))}
    status, value, hint = nccl_plugin.diagnose({**base, "LD_LIBRARY_PATH": f"{opt}/plugin/lib:{opt}/lib", **env})
    return {"status": status.upper(), "value": value, "hint": hint}


def test_doctor_follows_nccl_net(built: tuple[str, Path]) -> None:
    version, opt = built
    doctor = net_check
    # "AWS Libfabric" is accepted by both: 1.6.0's fixed name, and 1.21.1 renames itself to match at load.
    assert doctor(opt, NCCL_NET="AWS Libfabric")["status"] == "OK"
    ofi = doctor(opt, NCCL_NET="OFI")
    if version == "1.21.1":
        assert ofi["status"] == "OK" and "name 'OFI'" in ofi["value"]
    else:
        assert ofi["status"] == "FAIL" and "Failed to initialize any NET plugin" in ofi["hint"]
    assert doctor(opt, NCCL_NET="Socket")["status"] == "WARN"
    assert doctor(opt, NCCL_NET_PLUGIN="none")["value"].startswith("none loadable")
    by_name = doctor(opt, NCCL_NET_PLUGIN=f"{opt}/plugin/lib/libnccl-net.so", LD_LIBRARY_PATH=f"{opt}/lib")
    assert by_name["status"] == "OK" and f"{opt}/plugin/lib/libnccl-net.so" in by_name["value"]


def test_missing_cuda_crt_headers_fail_early_by_name(tmp_path: Path) -> None:
    archive("1.6.0")
    cuda = tmp_path / "cuda"
    (cuda / "include").mkdir(parents=True)
    shutil.copy(INPUTS / "cuda/include/cuda_runtime.h", cuda / "include")
    shutil.copytree(INPUTS / "cuda/lib64", cuda / "lib64", symlinks=True)
    proc = make_nccl_ofi(tmp_path, "1.6.0", CUDA_HOME=str(cuda))
    assert proc.returncode != 0
    assert "aws-ofi-nccl 1.6.0 needs CUDA headers: cuda_runtime.h and the crt/ headers" in proc.stderr
    assert "autogen.sh" not in proc.stdout + proc.stderr, "nothing is built before the inputs are checked"


def test_nccl_home_of_another_version_is_refused(tmp_path: Path) -> None:
    archive("1.6.0")
    proc = make_nccl_ofi(tmp_path, "1.6.0", PYTORCH_VERSION="2.13.0")
    assert proc.returncode != 0
    assert "holds NCCL 2.21.5, but PyTorch 2.13.0 is pinned to NCCL 2.29.3" in proc.stderr


def test_libfabric_below_the_configure_floor_fails_early(tmp_path: Path) -> None:
    """1.21.1's configure wants libfabric >= 1.11: an older one is named before anything is built."""
    archive("1.21.1")
    old = tmp_path / "libfabric"
    shutil.copytree(FABRIC_H.parent, old / "include/rdma")
    header = old / "include/rdma/fabric.h"
    header.write_text(header.read_text().replace("#define FI_MINOR_VERSION 17", "#define FI_MINOR_VERSION 10"))
    (old / "lib").mkdir()
    (old / "lib/libfabric.so").symlink_to("/usr/lib/x86_64-linux-gnu/libfabric.so.1")
    proc = make_nccl_ofi(tmp_path, "1.21.1", LIBFABRIC_ROOT=str(old))
    assert proc.returncode != 0
    assert f"aws-ofi-nccl 1.21.1 needs libfabric >= 1.11; {old} has 1.10" in proc.stderr
