"""accl's calls in torch's flight recorder: every rank dumps on a mismatch, in torch's format, and torch's own
analyzer (through ``torchhpc frtrace``) names the collective where the ranks diverged."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from _mpijob import run_mpi

from torchhpc.accl import core

SCRIPT = Path(__file__).with_name("accl_flight.py")


def _built() -> None:
    if not core.load_backend().flight_recorder_built():
        pytest.skip("accl was built without torch's flight recorder (nlohmann/json.hpp missing)")


def test_a_skipped_collective_is_named_by_torchs_analyzer(tmp_path: Path) -> None:
    _built()
    proc = run_mpi(3, [sys.executable, str(SCRIPT), str(tmp_path / "accl_trace_rank_")], timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for r in range(3):
        assert f"RANK {r} MismatchError" in proc.stdout, proc.stdout[-4000:]
    dumps = sorted(p.name for p in tmp_path.iterdir())
    assert dumps == [f"accl_trace_rank_{r}" for r in range(3)], dumps
    rank1 = pickle.loads((tmp_path / "accl_trace_rank_1").read_bytes())
    names = [(e["profiling_name"], e["collective_seq_id"], e["p2p_seq_id"], e["state"]) for e in rank1["entries"]]
    assert names == [("accl:all_reduce", 1, 0, "completed"), ("accl:all_reduce", 2, 0, "completed"),
                     ("accl:all_gather", 3, 0, "completed"), ("accl:recv 1<-0", 0, 1, "completed"),
                     ("accl:all_reduce", 4, 0, "started")], names
    assert rank1["entries"][2]["input_sizes"] == [[4]] and rank1["entries"][2]["output_sizes"] == [[4]] * 3
    assert rank1["pg_config"]["0"]["ranks"] == "[0, 1, 2]"
    analyzer = subprocess.run([sys.executable, "-m", "torchhpc", "frtrace", str(tmp_path)], capture_output=True,
                              text=True, timeout=120, check=False)
    text = analyzer.stdout + analyzer.stderr
    assert analyzer.returncode == 0, text
    assert "Collective sequence number: 4 has errors" in text, text
    assert "COLLECTIVE_TYPE_MISMATCH" in text and "'broadcast'" in text and "'all_reduce'" in text, text


def test_torchs_buffer_size_zero_records_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _built()
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    proc = run_mpi(2, [sys.executable, str(SCRIPT), str(tmp_path / "t_")], timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for r in range(2):
        assert pickle.loads((tmp_path / f"t_{r}").read_bytes())["entries"] == []


@pytest.mark.parametrize("stacks", [False, True])
def test_the_callers_python_stack_is_recorded_only_where_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               stacks: bool) -> None:
    _built()
    monkeypatch.setenv("TORCHHPC_ACCL_FLIGHT_STACKS", "1" if stacks else "0")
    proc = run_mpi(2, [sys.executable, str(SCRIPT), str(tmp_path / "s_")], timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    entries = pickle.loads((tmp_path / "s_0").read_bytes())["entries"]
    assert [e["profiling_name"] for e in entries[:3]] == ["accl:all_reduce", "accl:all_reduce", "accl:all_gather"]
    for e in entries:
        where = {(f["name"], Path(f["filename"]).name) for f in e.get("frames", [])}
        assert (("main", SCRIPT.name) in where) is stacks, e.get("frames")
        assert e["thread_name"] and e["state"] in ("completed", "started")


def frtrace(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torchhpc", "frtrace", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_frtrace_says_in_words_what_is_wrong_with_its_folder(tmp_path: Path) -> None:
    """No folder, a missing one, a file, an empty one, one holding something else, one with two jobs' names, an
    unreadable record: each a one-line error with exit code 2, never a traceback."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "rank_0").write_bytes(b"not a pickle")
    (tmp_path / "mixed").mkdir()
    for name in ("a_0", "b_1"):
        (tmp_path / "mixed" / name).write_bytes(pickle.dumps({}))
    (tmp_path / "file").write_text("x")
    cases = {(): "give the folder of the flight records",
             (str(tmp_path / "nowhere"),): "does not exist",
             (str(tmp_path / "file"),): "is not a folder",
             (str(tmp_path / "empty"),): "holds no flight records",
             (str(tmp_path / "junk"),): "is not a flight record",
             (str(tmp_path / "mixed"),): "do not share one name prefix"}
    for args, words in cases.items():
        proc = frtrace(*args)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert proc.stderr.startswith("torchhpc frtrace: "), proc.stderr


def test_frtrace_help_names_the_command_accl_and_the_variable() -> None:
    proc = frtrace("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: torchhpc frtrace"), proc.stdout
    for words in ("accl", "TORCH_FR_DUMP_TEMP_FILE", "--trust-others"):
        assert words in proc.stdout, proc.stdout
