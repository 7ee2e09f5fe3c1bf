#!/usr/bin/env bash
# Install torchhpc into the site's build environment (config_env.sh creates and activates it), with
# mpi4py compiled against the site's MPI (never a PyPI MPI wheel, which would not use the interconnect).
# Called by `make install-packages`; torch itself comes from `make build-pytorch-vX.Y.Z` and is never
# replaced here (torchhpc does not depend on torch in its metadata).
#
#   [SITE=...] [PYTORCH_VERSION=X.Y.Z] [DRY_RUN=1] utils/install_packages.sh
set -euo pipefail
# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
TORCHHPC_CREATE_ENV=1 load_config

if [[ "$DRY_RUN" != 1 && -z "${MPICC:-}" ]] && python -c 'import mpi4py.MPI' 2>/dev/null; then
  # a generic machine with an MPI wheel and no compiler wrapper: the mpi4py it came with is the one to use
  step "no mpicc in site '$TORCHHPC_SITE': keeping the environment's mpi4py, for $(python -c \
    'from mpi4py import MPI; print(MPI.Get_library_version().replace(chr(0), "").splitlines()[0].strip())')"
else
  step "mpi4py against ${MPICC:-<no mpicc>} into $TORCHHPC_ENV_PREFIX"
  [[ -n "${MPICC:-}" || "$DRY_RUN" == 1 ]] || die "no MPI compiler wrapper (mpicc) in site '$TORCHHPC_SITE'"
  run env MPICC="${MPICC:-mpicc}" python -m pip install --no-binary mpi4py --no-cache-dir "mpi4py>=3.1"
fi

# an editable install of this same checkout (make env) already follows it: replacing it would freeze a copy
editable='import pathlib, sys, torchhpc; sys.exit(pathlib.Path(sys.argv[1]) not in pathlib.Path(torchhpc.__file__).resolve().parents)'
if [[ "$DRY_RUN" != 1 ]] && python -c "$editable" "$TORCHHPC_ROOT/src" 2>/dev/null; then
  step "torchhpc: this checkout is installed in editable mode already; kept"
else
  step "torchhpc from $TORCHHPC_ROOT"
  run python -m pip install "$TORCHHPC_ROOT"
fi
run python -c "import mpi4py, torchhpc; print('torchhpc', torchhpc.__file__); print(mpi4py.get_config())"
