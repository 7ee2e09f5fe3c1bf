"""The ``torchhpc`` command: dispatches ``torchhpc <subcommand> ...`` to the module that implements it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module with a ``main(argv) -> int``, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("torchhpc.doctor", "check this environment for distributed training"),
    "bench": ("torchhpc.bench", "collective benchmarks: accl vs upstream MPI backend vs gloo vs raw MPI"),
    "jobscript": ("torchhpc.jobscript", "a PBS or Slurm job script for your own training command (--submit)"),
    "frtrace": ("torchhpc.frtrace", "PyTorch's flight-recorder analyzer (torchfrtrace), accl's dumps accepted"),
}


def _usage() -> str:
    lines = ["usage: torchhpc <subcommand> [options]", "", "subcommands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`torchhpc <subcommand> --help` for the options of each."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"torchhpc: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
