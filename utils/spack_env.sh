#!/usr/bin/env bash
# The Spack route: the repository root is a Spack environment (spack.yaml) and a Spack package repository
# (repo.yaml + packages/).  Called by `make spack-env` (concretize) and `make spack-install` (install).
#
#   [SITE=...] [DRY_RUN=1] utils/spack_env.sh setup|concretize|install|fake-install
#
# Which Spack: `spack` from PATH (or SPACK=/path/to/bin/spack) if there is one, else the commits of
# utils/spack_pins.tsv set up under $TORCHHPC_PREFIX/spack (default build/spack): unpacked from
# SPACK_ARCHIVES=<dir> (offline; the archives named in the table, e.g. ../shared/vendor) or cloned from GitHub.
# That private Spack gets its own config: the pinned builtin repository, the compilers found on PATH (gcc, g++,
# gfortran), SPACK_USER_CACHE_PATH under $TORCHHPC_PREFIX, no ~/.spack; Spack's Python is SPACK_PYTHON, else
# the project venv's python when it has clingo (pinned in requirements.lock), else Spack's own choice.
# The site's externals, MPI provider and cuda_arch live in utils/sites/<site>.spack.yaml; it is copied to
# build/spack-site.yaml, the file spack.yaml includes.  `concretize` also saves the concretized graph as
# $TORCHHPC_PREFIX/spack-<site>.lock and prints how long concretization took.
set -euo pipefail
# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

action=${1:-}
case "$action" in setup | concretize | install | fake-install) ;;
  *) die "usage: spack_env.sh setup|concretize|install|fake-install" ;;
esac
TORCHHPC_NO_ENV=1 TORCHHPC_NO_MODULES=1 TORCHHPC_QUIET=1 load_config
root=$TORCHHPC_ROOT
site_yaml="$root/utils/sites/$TORCHHPC_SITE.spack.yaml"
[[ -f "$site_yaml" ]] || die "no Spack site file $site_yaml for site '$TORCHHPC_SITE'"

pin() { # pin NAME COLUMN: a cell of utils/spack_pins.tsv
  awk -F'\t' -v n="$1" -v c="$2" '
    $1 == "name" { for (i = 1; i <= NF; i++) col[$i] = i; next }
    !/^#/ && $1 == n { print $col[c] }' "$root/utils/spack_pins.tsv"
}
spack_commit=$(pin spack commit)
packages_commit=$(pin spack-packages commit)
[[ -n "$spack_commit" && -n "$packages_commit" ]] || die "utils/spack_pins.tsv lacks the spack / spack-packages rows"

# fetch_pinned NAME DEST: the pinned commit of NAME into DEST, from SPACK_ARCHIVES or GitHub.
fetch_pinned() {
  local name=$1 dest=$2 commit archive
  commit=$(pin "$name" commit)
  archive=$(pin "$name" archive)
  if [[ -f "$dest/.torchhpc-commit" && "$(cat "$dest/.torchhpc-commit")" == "$commit" ]]; then
    return 0
  fi
  run rm -rf "$dest"
  if [[ -n "${SPACK_ARCHIVES:-}" ]]; then
    [[ "$DRY_RUN" == 1 || -f "$SPACK_ARCHIVES/$archive" ]] || die "SPACK_ARCHIVES=$SPACK_ARCHIVES has no $archive ($name $commit)"
    run mkdir -p "$dest"
    run tar xzf "$SPACK_ARCHIVES/$archive" -C "$dest" --strip-components=1
  else
    run git clone --quiet --filter=blob:none "https://github.com/$(pin "$name" upstream).git" "$dest"
    run git -C "$dest" checkout --quiet "$commit"
  fi
  [[ "$DRY_RUN" == 1 ]] || printf '%s\n' "$commit" >"$dest/.torchhpc-commit"
}

# Register gcc/g++/gfortran from PATH as the private Spack's compiler (what `spack compiler find` would write,
# without its minutes-long search of every PATH entry).
write_compilers() {
  local file=$1 gcc gxx gfortran version
  gcc=$(command -v gcc || true)
  gxx=$(command -v g++ || true)
  gfortran=$(command -v gfortran || true)
  [[ -n "$gcc" && -n "$gxx" ]] || die "no gcc/g++ on PATH for the private Spack (install them or put spack on PATH)"
  [[ -n "$gfortran" ]] || die "no gfortran on PATH: Spack's MPI and XBraid need a Fortran compiler (apt-get install gfortran)"
  version=$(gcc -dumpfullversion)
  [[ "$(g++ -dumpfullversion)" == "$version" && "$(gfortran -dumpfullversion)" == "$version" ]] \
    || die "gcc, g++ and gfortran on PATH are different versions; put one toolchain first on PATH"
  cat >"$file" <<EOF
# Written by utils/spack_env.sh from the compilers on PATH.
packages:
  gcc:
    externals:
    - spec: gcc@$version languages:='c,c++,fortran'
      prefix: $(dirname "$(dirname "$gcc")")
      extra_attributes:
        compilers:
          c: $gcc
          cxx: $gxx
          fortran: $gfortran
EOF
}

SPACK_CMD=()
if [[ -n "${SPACK:-}" ]] || command -v spack >/dev/null; then
  SPACK_CMD=("${SPACK:-$(command -v spack)}")
  have=$("${SPACK_CMD[@]}" --version 2>/dev/null || echo unknown)
  if [[ "$have" != "$(pin spack version)"* ]]; then
    echo "warning: using Spack $have from PATH; torchhpc is tested with Spack $(pin spack version)" \
      "(spack/spack $spack_commit) and spack-packages $packages_commit (utils/spack_pins.tsv)" >&2
  fi
else
  prefix=$TORCHHPC_PREFIX/spack
  step "Spack $(pin spack version) (spack/spack $spack_commit, spack-packages $packages_commit) in $prefix"
  fetch_pinned spack "$prefix/spack"
  fetch_pinned spack-packages "$prefix/spack-packages"
  if [[ "$DRY_RUN" != 1 ]]; then
    printf 'repos:\n  builtin: %s\n' "$prefix/spack-packages/repos/spack_repo/builtin" >"$prefix/spack/etc/spack/repos.yaml"
    mkdir -p "$prefix/spack/etc/spack/site"
    [[ -f "$prefix/spack/etc/spack/site/packages.yaml" ]] || write_compilers "$prefix/spack/etc/spack/site/packages.yaml"
  fi
  export SPACK_DISABLE_LOCAL_CONFIG=1 SPACK_USER_CACHE_PATH=$TORCHHPC_PREFIX/spack-cache
  if [[ -z "${SPACK_PYTHON:-}" && -x "$root/.venv/bin/python" ]] \
    && "$root/.venv/bin/python" -c 'import clingo' 2>/dev/null; then
    export SPACK_PYTHON=$root/.venv/bin/python
  fi
  SPACK_CMD=("$prefix/spack/bin/spack")
fi
[[ "$action" == setup ]] && { echo "spack: ${SPACK_CMD[*]}"; exit 0; }

step "Spack environment $root/spack.yaml, site file $site_yaml"
run mkdir -p "$root/build"
run cp "$site_yaml" "$root/build/spack-site.yaml"
case "$action" in
  concretize)
    start=$SECONDS
    run "${SPACK_CMD[@]}" -e "$root" concretize --force --fresh
    if [[ "$DRY_RUN" != 1 ]]; then
      cp "$root/spack.lock" "$TORCHHPC_PREFIX/spack-$TORCHHPC_SITE.lock"
      echo "concretized in $((SECONDS - start)) s; graph saved as $TORCHHPC_PREFIX/spack-$TORCHHPC_SITE.lock"
    fi
    ;;
  fake-install)
    # Walks the whole install graph (every package's install step is faked: no download, no build).
    run "${SPACK_CMD[@]}" -e "$root" install --fake --fail-fast
    ;;
  install)
    run "${SPACK_CMD[@]}" -e "$root" install --fail-fast
    echo "view: $root/build/spack-view (add its bin/ to PATH, or: spack env activate $root)"
    ;;
esac
