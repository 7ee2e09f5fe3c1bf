"""torchhpc doctor: the report, its JSON form, exit statuses, and the checks that read the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchhpc import doctor

LAUNCH_PREFIXES = ("OMPI_", "PMI_", "SLURM_", "PALS_", "MV2_")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher variables: the doctor sees a plain single process."""
    for key in list(os.environ):
        if key.startswith(LAUNCH_PREFIXES) or key in LAUNCH_VARS:
            monkeypatch.delenv(key)
    return monkeypatch


def report(capsys, *args: str) -> tuple[int, str]:
    status = doctor.main(list(args))
    return status, capsys.readouterr().out


def test_console_command_reports_every_check() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_PREFIXES) and k not in LAUNCH_VARS}
    res = subprocess.run([sys.executable, "-m", "torchhpc", "doctor"], capture_output=True, text=True, env=env,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "torchhpc doctor"
    for name in ("python", "torch", "launcher", "threads", "gpus", "mpi", "mpi threads", "fault tolerance",
                 "cuda-aware mpi", "backends", "flight record", "huge pages", "shared pages", "libfabric",
                 "site profile", "runtime vars"):
        assert any(line[7:].startswith(name + " ") for line in lines if line.startswith("[")), name
    for line in lines[1:-1]:
        assert line.startswith(("[ OK ]", "[WARN]", "[FAIL]", " ")), line
    assert lines[-1].endswith("FAIL")


def test_json_matches_and_strict_fails_on_warnings(clean_env, capsys) -> None:
    status, out = report(capsys, "--json")
    checks = json.loads(out)
    assert status == (1 if any(c["status"] == "FAIL" for c in checks) else 0)
    assert {c["status"] for c in checks} <= {"OK", "WARN", "FAIL"}
    assert all(c["hint"] for c in checks if c["status"] != "OK"), "every WARN/FAIL says what to do"
    by_name = {c["name"]: c for c in checks}
    assert by_name["mpi"]["status"] == "OK" and "MPI" in by_name["mpi"]["value"]
    strict, _ = report(capsys, "--strict")
    has_warn = any(c["status"] == "WARN" for c in checks)
    assert strict == (1 if has_warn else 0)


def test_contradictory_launch_is_a_failure(clean_env, capsys) -> None:
    for key, value in {"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        clean_env.setenv(key, value)
    status, out = report(capsys, "--json")
    assert status == 1
    launcher = next(c for c in json.loads(out) if c["name"] == "launcher")
    assert launcher["status"] == "FAIL" and "rank 3 >= world size 2" in launcher["value"]


def test_site_profile_and_runtime_variables_are_reported(clean_env, capsys) -> None:
    for key, value in {"TORCHHPC_SITE": "derecho", "TORCHHPC_SITE_PROFILE": "/x/derecho.sh",
                       "NCCL_SOCKET_IFNAME": "hsn", "FI_CXI_DISABLE_HOST_REGISTER": "1"}.items():
        clean_env.setenv(key, value)
    _, out = report(capsys, "--json")
    checks = {c["name"]: c for c in json.loads(out)}
    assert checks["site profile"]["value"] == "derecho (/x/derecho.sh)"
    assert "NCCL_SOCKET_IFNAME=hsn" in checks["runtime vars"]["value"]
    assert "FI_CXI_DISABLE_HOST_REGISTER=1" in checks["runtime vars"]["value"]


def test_plugin_search_follows_ld_library_path(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "libnccl-net.so").write_bytes(b"")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"/nonexistent:{tmp_path}")
    assert doctor._find_libs(doctor.AWS_OFI_LIBS) == [str(tmp_path / "libnccl-net.so")]
    monkeypatch.setenv("LD_LIBRARY_PATH", "/nonexistent")
    assert not any(str(tmp_path) in p for p in doctor._find_libs(doctor.AWS_OFI_LIBS))


def test_fi_info_providers_are_parsed(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in fi_info printing the real `fi_info -l` layout (no libfabric on this machine).
    fake = tmp_path / "fi_info"
    listing = "cxi:\\n    version: 0.1\\ntcp:\\n    version: 0.1\\nshm:\\n    version: 1\\n"
    fake.write_text(f"#!/bin/sh\nprintf '{listing}'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    check = doctor._libfabric()
    assert check.status == "OK" and check.value == "providers: cxi, shm, tcp"


def test_a_crashing_check_is_reported_not_raised() -> None:
    def boom() -> doctor.Check:
        raise RuntimeError("kaput")

    [check] = doctor._guard("thing", boom)
    assert check.status == "FAIL" and "kaput" in check.value


def test_fault_tolerance_follows_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchhpc import doctor
    from torchhpc.runtime import mpi_info

    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    capable, enabled = mpi_info.fault_tolerance()
    assert not enabled
    check = doctor._fault_tolerance()
    if capable:  # e.g. the PyPI Open MPI, built with ULFM: the hint gives the launch options
        assert "off for this job" in check.value and "--with-ft ulfm" in check.hint
        monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "1")  # what `mpiexec --with-ft ulfm` sets in its ranks
        assert mpi_info.fault_tolerance() == (True, True)
        assert "ULFM on" in doctor._fault_tolerance().value
    else:
        assert "no ULFM" in check.value


def test_one_reading_of_what_an_mpi_says_of_itself() -> None:
    """Libraries' and launchers' own words (both wheels' mpiexec here, and the texts of Cray MPICH, Intel MPI,
    MVAPICH) map to the family every part of torchhpc uses: accl's loader, the upstream backend, mpiexec's
    flags."""
    from mpi4py import MPI

    from torchhpc.runtime.mpi_info import family_of_text

    venv = Path(sys.executable).parent
    ompi = subprocess.run([venv / "mpiexec", "--version"], capture_output=True, text=True, check=False).stdout
    hydra = subprocess.run([venv.parent / "mpich" / "bin" / "mpiexec", "--version"], capture_output=True, text=True,
                           check=False).stdout
    assert family_of_text(ompi) == "openmpi" and family_of_text(hydra) == "mpich", (ompi, hydra)
    assert family_of_text(MPI.Get_library_version()) in ("openmpi", "mpich")
    for text in ("MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)", "Intel(R) MPI Library 2021.10",
                 "MVAPICH2 Version      :	2.3.7"):
        assert family_of_text(text) == "mpich", text
    assert family_of_text("Microsoft MPI 10.1.12498.18") is None


def test_the_flight_recorder_is_reported_built_or_how_to_build_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchhpc.accl import core

    built = core.load_backend().flight_recorder_built()
    check = doctor.run_checks(probe=False)
    found = [c for c in check if c.name == "flight record"]
    assert len(found) == 1 and (found[0].status == doctor.OK) == built, found
    if built:
        assert core.flight_prefix() in found[0].value, found
    unbuilt = type("Unbuilt", (), {"flight_recorder_built": lambda self: False})()
    monkeypatch.setattr(core, "load_backend", lambda: unbuilt)
    found = [c for c in doctor.run_checks(probe=False) if c.name == "flight record"]
    assert found[0].status == doctor.WARN and "nlohmann" in found[0].hint and "make env" in found[0].hint, found
