"""Collective benchmark: accl vs PyTorch's MPI backend (mpi_upstream) vs gloo vs raw MPI on torch memory, the five
collectives (``torchhpc bench``, see ``torchhpc.bench``; ``torchhpc bench all --np 2`` is the same).

Run under mpiexec (``mpiexec -n 2 python bench/allreduce.py all --quick``) or plainly
(``python bench/allreduce.py all --np 2 --json bench.json --plot busbw.png``), which starts mpiexec itself.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from torchhpc.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
