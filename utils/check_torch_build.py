"""Check an installed source build of torch: exact version, MPI backend, and CUDA + NCCL when expected.

Run by utils/build_pytorch.sh as the last step; exits non-zero, naming what is missing, on any failure.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Print what the installed torch/torchvision provide and compare with what the build asked for."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--torch-version", required=True, help="expected torch.__version__")
    parser.add_argument("--torchvision-version", help="expected torchvision.__version__")
    parser.add_argument("--cuda", type=int, choices=(0, 1), default=0,
                        help="1: CUDA and NCCL must be built in")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    problems = []
    print(f"torch {torch.__version__} from {torch.__file__}")
    if torch.__version__ != args.torch_version:
        problems.append(f"torch is {torch.__version__}, expected {args.torch_version}")
    if not dist.is_mpi_available():
        problems.append("torch was built without the MPI backend (USE_MPI=1 and an MPI on PATH are needed)")
    if args.cuda:
        if not torch.backends.cuda.is_built():
            problems.append("torch was built without CUDA")
        elif not dist.is_nccl_available():
            problems.append("torch was built without NCCL")
        else:
            print(f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    if args.torchvision_version:
        import torchvision

        print(f"torchvision {torchvision.__version__}")
        if torchvision.__version__ != args.torchvision_version:
            problems.append(f"torchvision is {torchvision.__version__}, expected {args.torchvision_version}")
    for problem in problems:
        print(f"check_torch_build: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
