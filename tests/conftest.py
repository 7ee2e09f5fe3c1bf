"""Shared pytest set-up: tests import torchhpc from src/ even without `make env`'s editable install."""

import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))
