"""Huge pages for torch's CPU tensors: torchhpc's default (import, local jobs, activation hook), what torch does
with THP_MEM_ALLOC_ENABLE and when it reads it, and the doctor's "huge pages" line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torchhpc import doctor
from torchhpc.runtime import hugepages
from torchhpc.runtime.mpirun import local_job_env

ROOT = Path(__file__).resolve().parents[1]
MODE = hugepages.kernel_setting("enabled")
HUGE_OK = MODE in ("always", "madvise")


def fake_sysfs(tmp_path: Path, enabled: str, defrag: str = "madvise") -> str:
    """A stand-in for /sys/kernel/mm/transparent_hugepage with ``enabled`` and ``defrag`` selected."""
    root = tmp_path / "thp"
    root.mkdir(exist_ok=True)
    modes = ("always", "madvise", "never")
    (root / "enabled").write_text(" ".join(f"[{m}]" if m == enabled else m for m in modes) + "\n")
    defrags = ("always", "defer", "defer+madvise", "madvise", "never")
    (root / "defrag").write_text(" ".join(f"[{m}]" if m == defrag else m for m in defrags) + "\n")
    return str(root)


def run_py(code: str, **env: str | None) -> str:
    """Run ``code`` in a fresh interpreter with ``env`` applied to this environment (None: unset)."""
    full = dict(os.environ)
    for key, value in env.items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.strip()


# ------------------------------------------------------------------------------------------- the default


def test_kernel_setting_reads_the_bracketed_mode(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, "madvise", "defer+madvise")
    assert hugepages.kernel_setting("enabled", root) == "madvise"
    assert hugepages.kernel_setting("defrag", root) == "defer+madvise"
    assert hugepages.kernel_setting("enabled", str(tmp_path / "missing")) is None


@pytest.mark.parametrize(("mode", "expected"), [("madvise", "1"), ("always", "1"), ("never", None)])
def test_set_default_follows_the_kernel_and_keeps_a_users_value(tmp_path: Path, mode: str,
                                                                expected: str | None) -> None:
    root = fake_sysfs(tmp_path, mode)
    env: dict[str, str] = {}
    assert hugepages.set_default(env, root) == (expected is not None)
    assert env.get(hugepages.VAR) == expected
    mine = {hugepages.VAR: "0"}
    assert not hugepages.set_default(mine, root) and mine == {hugepages.VAR: "0"}
    none: dict[str, str] = {}
    assert not hugepages.set_default(none, str(tmp_path / "no-thp")) and none == {}


def test_local_jobs_get_it_by_default_and_keep_a_users_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hugepages, "SYSFS", fake_sysfs(tmp_path, "madvise"))
    assert local_job_env({})[hugepages.VAR] == "1"
    assert local_job_env({hugepages.VAR: "0"})[hugepages.VAR] == "0"
    monkeypatch.setattr(hugepages, "SYSFS", fake_sysfs(tmp_path, "never"))
    assert hugepages.VAR not in local_job_env({})


@pytest.mark.skipif(not HUGE_OK, reason=f"kernel THP mode is {MODE}: the default is not set")
def test_import_torchhpc_sets_it_before_torchs_first_tensor() -> None:
    code = ("import os, torchhpc, torch; from torchhpc.runtime.hugepages import torch_thp_alloc, INHERITED; "
            "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), INHERITED, torch_thp_alloc())")
    assert run_py(code, THP_MEM_ALLOC_ENABLE=None) == "1 None True"
    assert run_py(code, THP_MEM_ALLOC_ENABLE="0") == "0 0 False"


def test_torch_reads_the_variable_once_at_its_first_allocation_of_any_size() -> None:
    # os.environ after `import torch` still counts; after one 40-byte tensor it no longer does.
    code = ("import os, torch; from torchhpc.runtime.hugepages import torch_thp_alloc; {before}"
            "os.environ['THP_MEM_ALLOC_ENABLE'] = '1'; print(torch_thp_alloc(4 << 20), torch_thp_alloc(1 << 20))")
    assert run_py(code.format(before=""), THP_MEM_ALLOC_ENABLE="0") == "True False"  # (< 2 MiB: never)
    assert run_py(code.format(before="torch.ones(10); "), THP_MEM_ALLOC_ENABLE="0") == "False False"


@pytest.mark.skipif(not HUGE_OK, reason=f"kernel THP mode is {MODE}: no huge pages for anyone")
def test_a_4mib_tensor_gets_huge_pages_with_the_variable() -> None:
    code = ("import json, torch; from torchhpc.runtime.hugepages import huge_kib; "
            "t = torch.empty(4 << 20, dtype=torch.uint8).fill_(1); "
            "print(json.dumps([t.data_ptr() % 4096, huge_kib(t.data_ptr(), t.numel())]))")
    offset, kib = json.loads(run_py(code, THP_MEM_ALLOC_ENABLE="1"))
    assert offset == 0 and kib >= 2048, (offset, kib)  # page-aligned; one aligned 2 MiB at least
    if MODE == "madvise":  # without the variable torch does not madvise: 4 KiB pages only
        offset, kib = json.loads(run_py(code, THP_MEM_ALLOC_ENABLE="0"))
        assert kib == 0, kib


# ------------------------------------------------------------------------------------------- activation hook


def hook_env(tmp_path: Path) -> Path:
    prefix = tmp_path / "condaenv"
    prefix.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TORCHHPC_SITE": "generic",
           "NCCL_OFI_PREFIX": "/opt/nccl", "TORCHHPC_SITE_PROFILE": str(ROOT / "utils/sites/generic.sh")}
    subprocess.run(["bash", "utils/write_activation_hook.sh", "conda", str(prefix)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=30)
    return prefix


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_activation_hook_exports_it_unless_set_and_deactivate_restores(tmp_path: Path, before: str | None) -> None:
    prefix = hook_env(tmp_path)
    act, deact = prefix / "etc/conda/activate.d/torchhpc.sh", prefix / "etc/conda/deactivate.d/torchhpc.sh"
    pre = "" if before is None else f"THP_MEM_ALLOC_ENABLE={before}; export THP_MEM_ALLOC_ENABLE; "
    script = (f'{pre}. "{act}"; . "{act}"; echo "on=${{THP_MEM_ALLOC_ENABLE-unset}}"; '
              f'. "{deact}"; echo "off=${{THP_MEM_ALLOC_ENABLE-unset}}"')
    sh = shutil.which("dash") or "sh"
    out = subprocess.run([sh, "-c", script], env={"PATH": os.environ["PATH"]}, capture_output=True, text=True,
                         timeout=30, check=True).stdout.split()
    default = "1" if HUGE_OK else "unset"
    assert out == [f"on={before or default}", f"off={before or 'unset'}"]


# ------------------------------------------------------------------------------------------- doctor


@pytest.fixture
def doctor_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The doctor's huge-pages check against a fake sysfs, with torch's in-process state stubbed."""
    monkeypatch.setattr(hugepages, "torch_thp_alloc", lambda nbytes=4 << 20: True)
    monkeypatch.setattr(doctor, "_probe_huge_kib", lambda nbytes=4 << 20: 2048)

    def check(mode: str | None, value: str | None, inherited: str | None = None) -> doctor.Check:
        monkeypatch.setattr(hugepages, "INHERITED", inherited)
        if value is None:
            monkeypatch.delenv(hugepages.VAR, raising=False)
        else:
            monkeypatch.setenv(hugepages.VAR, value)
        root = fake_sysfs(tmp_path, mode) if mode else str(tmp_path / "missing")
        return doctor._huge_pages(root)

    return check


def test_doctor_reports_huge_pages_in_force(doctor_env) -> None:
    check = doctor_env("madvise", "1")
    assert check.status == "OK" and check.name == "huge pages"
    assert "THP_MEM_ALLOC_ENABLE=1 (set by `import torchhpc`)" in check.value
    assert "enabled=madvise, defrag=madvise" in check.value and "2048 KiB in huge pages" in check.value
    assert "export THP_MEM_ALLOC_ENABLE=1 in job scripts" in check.hint
    inherited = doctor_env("madvise", "1", inherited="1")
    assert "(from the environment)" in inherited.value and not inherited.hint


def test_doctor_reports_huge_pages_off_with_the_documented_cost(doctor_env) -> None:
    off = doctor_env("madvise", "0", inherited="0")
    assert off.status == "OK" and "opted out" in off.value and "4 KiB pages" in off.value
    assert "docs/accl.md" in off.hint and "16 MiB all-reduce" in off.hint
    bad = doctor_env("madvise", "yes", inherited="yes")
    assert bad.status == "WARN" and "torch ignores it" in bad.value and bad.hint
    never = doctor_env("never", "1", inherited="1")
    assert never.status == "WARN" and "does nothing" in never.value and never.hint
    assert doctor_env(None, None).status == "OK"
    assert "with or without the variable" in doctor_env("always", "0", inherited="0").value


def test_doctor_says_when_torch_read_the_variable_too_early(doctor_env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hugepages, "torch_thp_alloc", lambda nbytes=4 << 20: False)
    check = doctor_env("madvise", "1")
    assert check.status == "WARN" and "read it before it was set" in check.value


@pytest.mark.skipif(not HUGE_OK, reason=f"kernel THP mode is {MODE}")
def test_doctor_command_line_both_states() -> None:
    code = ("import json; from torchhpc import doctor; "
            "print(json.dumps([c.__dict__ for c in doctor._guard('huge pages', doctor._huge_pages)]))")
    [on] = json.loads(run_py(code, THP_MEM_ALLOC_ENABLE=None))
    assert on["status"] == "OK" and on["value"].startswith("THP_MEM_ALLOC_ENABLE=1 (set by `import torchhpc`)")
    [off] = json.loads(run_py(code, THP_MEM_ALLOC_ENABLE="0"))
    assert off["status"] == "OK" and "opted out" in off["value"] and "docs/accl.md" in off["hint"]
