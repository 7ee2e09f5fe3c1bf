# shellcheck shell=bash
# Helpers shared by the executed build scripts in utils/ (each of which runs under `set -euo pipefail`).
#
#   DRY_RUN=1   every `run` prints the exact command (shell-quoted) instead of running it; stamps are
#               neither checked nor written, so a dry run always shows every step.
#   Stamps      $TORCHHPC_PREFIX/stamps/<name>: a finished step writes its stamp (holding what it was
#               built from); a later run whose stamp matches skips the step.

DRY_RUN=${DRY_RUN:-0}

step() { printf '\n==> %s\n' "$*" >&2; }
die() { printf '%s: error: %s\n' "${0##*/}" "$*" >&2; exit 1; }

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
