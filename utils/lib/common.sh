# shellcheck shell=bash
# Helpers shared by the executed build scripts in utils/ (each of which runs under `set -euo pipefail`).
#
#   DRY_RUN=1   every `run` prints the exact command (shell-quoted) instead of running it; stamps are
#               neither checked nor written, so a dry run always shows every step.
#   Stamps      $TORCHHPC_PREFIX/stamps/<name>: a finished step writes its stamp (holding what it was
#               built from); a later run whose stamp matches skips the step.

DRY_RUN=${DRY_RUN:-0}

step() { printf '\n==> %s\n' "$*" >&2; }
# TORCHHPC_PROG: the command the user typed (torchhpc jobscript sets it), else this script's name
die() { printf '%s: error: %s\n' "${TORCHHPC_PROG:-${0##*/}}" "$*" >&2; exit 1; }

# Print a command exactly as a shell would read it back.
quote_cmd() {
  local out="" arg
  for arg in "$@"; do out+="$(printf '%q' "$arg") "; done
  printf '%s\n' "${out% }"
}

run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '+ %s\n' "$(quote_cmd "$@")"
  else
    printf '+ %s\n' "$(quote_cmd "$@")" >&2
    "$@"
  fi
}

# run_in DIR CMD...: run CMD inside DIR (printed as `cd DIR && CMD` in a dry run).
run_in() {
  local dir=$1
  shift
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '+ cd %q && %s\n' "$dir" "$(quote_cmd "$@")"
  else
    printf '+ (cd %q && %s)\n' "$dir" "$(quote_cmd "$@")" >&2
    (cd "$dir" && "$@")
  fi
}

# stamp_ok NAME CONTENT: true when step NAME already finished from the same CONTENT.
stamp_ok() {
  [[ "$DRY_RUN" != 1 && -f "$TORCHHPC_PREFIX/stamps/$1" && "$(cat "$TORCHHPC_PREFIX/stamps/$1")" == "$2" ]]
}

stamp_write() {
  [[ "$DRY_RUN" == 1 ]] && return 0
  mkdir -p "$TORCHHPC_PREFIX/stamps"
  printf '%s\n' "$2" >"$TORCHHPC_PREFIX/stamps/$1"
}

# Source config_env.sh into this script. It is written for interactive shells (no `set -u`), and conda's
# activation scripts read unset variables, so nounset is off while it runs. A dry run never creates or
# activates an environment.
load_config() {
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  [[ "$DRY_RUN" == 1 ]] && export TORCHHPC_NO_ENV=1
  set +u
  # shellcheck source=config_env.sh
  source "$root/config_env.sh" || { set -u; die "config_env.sh failed (see above)"; }
  set -u
}

# print_vars NAME...: NAME=value lines, so a dry run shows the configuration a real run would use.
print_vars() {
  local v
  for v in "$@"; do printf '%s=%s\n' "$v" "${!v-}"; done
}

# nvcc_release CUDA_HOME: the toolkit's major.minor from its nvcc (nothing when there is no nvcc there).
nvcc_release() {
  [[ -x "$1/bin/nvcc" ]] || return 0
  "$1/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p'
}

# cuda_unfit VERSION: why the site's CUDA (a cuda/, cudatoolkit/ or cudatoolkit-standalone/X.Y module of its
# profile, else CUDA_HOME's nvcc) is older than the one PyTorch VERSION was released for; nothing when it is
# not, or when either is unknown.  After load_config.  A build on it fails hours in, so the build and its submission stop on it first.
cuda_unfit() {
  local version=$1 want have="" m
  for m in ${TORCHHPC_SITE_MODULES:-}; do
    [[ "$m" =~ ^(cuda|cudatoolkit|cudatoolkit-standalone)/([0-9]+\.[0-9]+) ]] && have=${BASH_REMATCH[2]}
  done
  [[ -n "$have" || -z "${CUDA_HOME:-}" ]] || have=$(nvcc_release "$CUDA_HOME")
  want=$("$TORCHHPC_ROOT/utils/pytorch_version.sh" "$version" cuda) || want=""
  [[ -n "$have" && -n "$want" ]] || return 0
  if (( ${have%%.*} < ${want%%.*} || (${have%%.*} == ${want%%.*} && ${have#*.} < ${want#*.}) )); then
    local why="PyTorch $version was released for CUDA $want; site '$TORCHHPC_SITE' builds with CUDA $have."
    why+=" Use a newer CUDA (e.g. CUDA_MODULE=cuda/$want... where the profile takes it; \`module avail cuda\`),"
    why+=" or a release made for CUDA <= $have (\`make cluster-versions\`); CUDA_MISMATCH_OK=1 builds anyway"
    printf '%s\n' "$why"
  fi
}
