"""``python -m torchhpc.bench``: the ``torchhpc bench`` command (how it relaunches itself under mpiexec)."""

import sys

from .cli import main

raise SystemExit(main(sys.argv[1:]))
