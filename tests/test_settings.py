"""Every TORCHHPC_* number, switch and choice parsed in one place (torchhpc.runtime.settings): a bad value is an
error that names the variable and what it takes, at the first read and in `torchhpc doctor`; the rendezvous store
listens on the job's interface, not on every one."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from torchhpc.runtime import settings
from torchhpc.runtime.settings import SettingError


@pytest.mark.parametrize(("name", "raw", "says"), [
    ("TORCHHPC_RANKS_PER_NODE", "abc", "a whole number >= 1"),
    ("TORCHHPC_RANKS_PER_NODE", "0", "a whole number >= 1"),
    ("TORCHHPC_ACCL_RING_MIN_BYTES", "-5", "a whole number >= 0"),
    ("TORCHHPC_ACCL_START_PORT", "-1", "a whole number >= 1 and <= 65535"),
    ("TORCHHPC_ACCL_START_PORT", "70000", "a whole number >= 1 and <= 65535"),
    ("TORCHHPC_ACCL_BUFSIZE", "-7", "a whole number >= 1"),
    ("TORCHHPC_ACCL_SPIN_US", "abc", "a whole number >= 0"),
    ("TORCHHPC_ACCL_FLIGHT_STACKS", "maybe", "1/0, true/false"),
    ("TORCHHPC_ACCL_ENGINE", "fpga", "one of mpi, accl"),
    ("TORCHHPC_BRAID_TIMEOUT", "nan", "a number >= 0.001"),
    ("TORCHHPC_MPI_FAMILY", "lam", "one of openmpi, mpich"),
])
def test_a_bad_value_names_its_variable(name: str, raw: str, says: str) -> None:
    with pytest.raises(SettingError, match=rf"^{name}='{raw}': .* takes {says}"):
        settings.get(name, {name: raw})
    assert any(name in p for p in settings.problems({name: raw}))
    assert settings.problems({}) == []
    assert settings.get(name, {name: ""}) == settings.SETTINGS[name].default  # empty: the default


def test_every_reader_goes_through_the_one_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """The values the issue found accepted or failing with a bare int() error, through each reader."""
    from torchhpc.braid import transport
    from torchhpc.runtime.mpi_info import cuda_aware_query

    monkeypatch.setenv("TORCHHPC_BRAID_TIMEOUT", "soon")
    with pytest.raises(SettingError, match="TORCHHPC_BRAID_TIMEOUT='soon'"):
        transport.default_timeout()
    monkeypatch.setenv("TORCHHPC_BRAID_TIMEOUT", "2.5")
    assert transport.default_timeout() == 2.5
    monkeypatch.setenv("TORCHHPC_CUDA_AWARE_MPI", "perhaps")
    with pytest.raises(SettingError, match="TORCHHPC_CUDA_AWARE_MPI"):
        cuda_aware_query()
    monkeypatch.setenv("TORCHHPC_CUDA_AWARE_MPI", "yes")
    assert cuda_aware_query().supported is True


@pytest.mark.parametrize(("var", "raw"), [("TORCHHPC_ACCL_RING_MIN_BYTES", "-5"),
                                          ("TORCHHPC_ACCL_START_PORT", "-1"), ("TORCHHPC_ACCL_BUFSIZE", "-7"),
                                          ("TORCHHPC_ACCL_SPIN_US", "abc")])
def test_accl_options_refuse_what_their_variables_refuse(monkeypatch: pytest.MonkeyPatch, var: str, raw: str) -> None:
    pytest.importorskip("mpi4py")
    from torchhpc.accl import AcclOptions

    monkeypatch.setenv(var, raw)
    with pytest.raises(SettingError, match=var):
        AcclOptions()
    monkeypatch.delenv(var)
    field = var.removeprefix("TORCHHPC_").lower().removeprefix("accl_")
    field = {"start_port": "accl_start_port", "bufsize": "accl_bufsize"}.get(field, field)
    with pytest.raises(ValueError, match=f"AcclOptions.{field} must be"):
        AcclOptions(**{field: -9})


def test_doctor_fails_a_bad_value_and_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchhpc import doctor

    monkeypatch.setenv("TORCHHPC_ACCL_SPIN_US", "abc")
    check = next(c for c in doctor.run_checks() if c.name == "runtime vars")
    assert check.status == doctor.FAIL and "TORCHHPC_ACCL_SPIN_US='abc'" in check.hint


def _listening_address(port: int) -> str:
    """The local address a TCP socket listens on at ``port`` on this host (from /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hexport = local.split(":")
        if state == "0A" and int(hexport, 16) == port:
            return ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
    return ""


def test_the_rendezvous_store_listens_on_the_jobs_interface_only() -> None:
    """torch's TCPStore listens on every interface: on a one-node job, other hosts' users reached it."""
    from torchhpc.launcher import job_store

    timeout = datetime.timedelta(seconds=30)
    store = job_store("127.0.0.1", 0, 2, True, timeout)
    assert _listening_address(store.port) == "127.0.0.1"
    peer = job_store("127.0.0.1", store.port, 2, False, timeout)
    peer.set("k", "v")
    assert store.get("k") == b"v"
    from torchhpc.runtime.errors import LauncherError

    with pytest.raises(LauncherError, match=f"cannot listen on 127.0.0.1:{store.port}.*MASTER_PORT"):
        job_store("127.0.0.1", store.port, 2, True, timeout)  # taken (by another user, say)


def test_every_accl_option_is_one_row_of_the_docs_table_with_the_settings_default() -> None:
    """docs/accl.md's options table is the one list: a row per AcclOptions field, named with its variable, and
    for the variables torchhpc.runtime.settings parses, the same default there as in the table."""
    import dataclasses

    from torchhpc.accl import AcclOptions
    from torchhpc.runtime.settings import SETTINGS

    text = (Path(__file__).resolve().parents[1] / "docs" / "accl.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1].startswith("TORCHHPC_ACCL_"):
            rows[cells[0]] = cells
    fields = [f.name for f in dataclasses.fields(AcclOptions)]
    assert sorted(rows) == sorted(fields), (sorted(rows), sorted(fields))
    for field, (_, variable, default, _, why) in rows.items():
        assert variable == "TORCHHPC_ACCL_" + field.upper().removeprefix("ACCL_") and why, field
        setting = SETTINGS.get(variable)
        if setting is None:
            continue
        if setting.default is None:
            assert default.startswith("unset"), (variable, default)
        elif setting.kind == "bool":
            assert default == ("on" if setting.default else "off"), (variable, default)
        else:
            assert default.strip("`") == str(setting.default), (variable, default, setting.default)
