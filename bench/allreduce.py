"""Collective benchmark: accl vs gloo vs raw mpi4py (see ``torchhpc.accl.bench``).

Run under mpiexec (``mpiexec -n 2 python bench/allreduce.py allreduce --quick``) or plainly
(``python bench/allreduce.py --np 2``), which starts mpiexec itself.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from torchhpc.accl.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
