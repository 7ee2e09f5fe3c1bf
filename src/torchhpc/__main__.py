"""``python -m torchhpc ...`` is the ``torchhpc`` command."""

from torchhpc.cli import main

raise SystemExit(main())
