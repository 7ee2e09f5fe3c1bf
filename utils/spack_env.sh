#!/usr/bin/env bash
# The Spack route: the repository root is a Spack environment (spack.yaml) and a Spack package repository
# (repo.yaml + packages/).  Called by `make spack-env` (concretize) and `make spack-install` (install).
#
#   [SITE=...] [DRY_RUN=1] utils/spack_env.sh concretize|install
#
# The site's externals (cray-mpich, libfabric, cuda, openpbs) and cuda_arch live in
# utils/sites/<site>.spack.yaml; it is copied to build/spack-site.yaml, the file spack.yaml includes.
set -euo pipefail
# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

action=${1:-}
case "$action" in concretize | install) ;; *) die "usage: spack_env.sh concretize|install" ;; esac
TORCHHPC_NO_ENV=1 TORCHHPC_NO_MODULES=1 TORCHHPC_QUIET=1 load_config
site_yaml="$TORCHHPC_ROOT/utils/sites/$TORCHHPC_SITE.spack.yaml"
[[ -f "$site_yaml" ]] || die "no Spack site file $site_yaml for site '$TORCHHPC_SITE'"
if [[ "$DRY_RUN" != 1 ]]; then
  command -v spack >/dev/null \
    || die "no 'spack' command: set up Spack first (. <spack>/share/spack/setup-env.sh) or use make build-pytorch-*"
fi

step "Spack environment $TORCHHPC_ROOT/spack.yaml, site file $site_yaml"
run mkdir -p "$TORCHHPC_ROOT/build"
run cp "$site_yaml" "$TORCHHPC_ROOT/build/spack-site.yaml"
if [[ "$action" == concretize ]]; then
  run spack -e "$TORCHHPC_ROOT" concretize --force --fresh
else
  run spack -e "$TORCHHPC_ROOT" install --fail-fast
  echo "view: $TORCHHPC_ROOT/build/spack-view (add its bin/ to PATH, or: spack env activate $TORCHHPC_ROOT)"
fi
