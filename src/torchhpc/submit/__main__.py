"""``python -m torchhpc.submit FOLDER``: what each rank of a job written by :mod:`torchhpc.submit` runs."""

import sys

from .worker import main

raise SystemExit(main(sys.argv[1:]))
