"""torchhpc doctor under mpiexec: sees the MPI launcher, prints once (rank 0), agrees on the exit status."""

from mpi4py import MPI

from torchhpc import doctor


def test_doctor_under_mpiexec(comm: MPI.Comm, capsys) -> None:
    status = doctor.main(["--json"])
    out = capsys.readouterr().out
    assert comm.allgather(status) == [status] * comm.Get_size()
    if comm.Get_rank() == 0:
        assert f"rank 0/{comm.Get_size()}" in out
    else:
        assert out == ""
