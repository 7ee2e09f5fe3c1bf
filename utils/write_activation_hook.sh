#!/usr/bin/env bash
# Write the site's runtime settings into an environment as an activation hook:
#
#   utils/write_activation_hook.sh conda|venv PREFIX
#
# Reads TORCHHPC_SITE, TORCHHPC_SITE_PROFILE and NCCL_OFI_PREFIX (exported by config_env.sh) and writes
#   PREFIX/etc/torchhpc/activate.sh    the profile's site_runtime_env lines (each documented), after saving
#                                      every variable they touch, then THP_MEM_ALLOC_ENABLE=1 unless set
#                                      (huge pages for torch's CPU tensors, see docs/accl.md);
#   PREFIX/etc/torchhpc/deactivate.sh  puts those variables back as they were before activation;
# then wires them in: conda  -> PREFIX/etc/conda/{activate,deactivate}.d/torchhpc.sh
#                     venv   -> a marked block appended once to PREFIX/bin/activate (bash also gets the
#                               restore on `deactivate`).
# Re-running rewrites the hook from the current profile; the venv block is never duplicated.
set -euo pipefail

die() { echo "write_activation_hook.sh: error: $*" >&2; exit 1; }
(($# == 2)) || die "usage: write_activation_hook.sh conda|venv PREFIX"
kind=$1 prefix=$2
case "$kind" in conda | venv) ;; *) die "kind '$kind' is not conda or venv" ;; esac
[[ -d "$prefix" ]] || die "environment prefix '$prefix' does not exist"
: "${TORCHHPC_SITE:?set by config_env.sh}" "${TORCHHPC_SITE_PROFILE:?set by config_env.sh}"
: "${NCCL_OFI_PREFIX:?set by config_env.sh}"
[[ -f "$TORCHHPC_SITE_PROFILE" ]] || die "site profile $TORCHHPC_SITE_PROFILE not found"

# shellcheck source=utils/sites/generic.sh
source "$TORCHHPC_SITE_PROFILE"
declare -F site_runtime_env >/dev/null || die "$TORCHHPC_SITE_PROFILE defines no site_runtime_env"
body=$(site_runtime_env)
# Every variable the hook sets or unsets, in order, without repeats.
mapfile -t names < <(printf '%s\n' "$body" \
  | sed -nE 's/^[[:space:]]*export[[:space:]]+([A-Za-z_][A-Za-z0-9_]*)=.*/\1/p; s/^[[:space:]]*unset[[:space:]]+([A-Za-z_][A-Za-z0-9_]*).*/\1/p' \
  | awk '!seen[$0]++')
names=(TORCHHPC_SITE TORCHHPC_SITE_PROFILE "${names[@]}")
[[ " ${names[*]} " == *" THP_MEM_ALLOC_ENABLE "* ]] || names+=(THP_MEM_ALLOC_ENABLE)

dir="$prefix/etc/torchhpc"
mkdir -p "$dir"
{
  echo "# torchhpc activation hook for site '$TORCHHPC_SITE', written by utils/write_activation_hook.sh from"
  echo "# $TORCHHPC_SITE_PROFILE (site_runtime_env). Do not edit: re-source config_env.sh to regenerate."
  echo "# POSIX sh; saves each variable it changes so deactivate.sh can restore it."
  echo "if [ -n \"\${_TORCHHPC_HOOK_ACTIVE:-}\" ]; then . \"$dir/deactivate.sh\"; fi"
  echo "for _torchhpc_n in ${names[*]}; do"
  echo "  if eval \"[ -n \\\"\\\${\$_torchhpc_n+x}\\\" ]\"; then"
  echo "    eval \"_TORCHHPC_OLD_\$_torchhpc_n=\\\"\\\${\$_torchhpc_n}\\\"; export _TORCHHPC_OLD_\$_torchhpc_n\""
  echo "  fi"
  echo "done"
  echo "unset _torchhpc_n"
  echo "export _TORCHHPC_HOOK_ACTIVE=1"
  echo "# What \`torchhpc doctor\` reports as the site profile."
  echo "export TORCHHPC_SITE=$TORCHHPC_SITE"
  echo "export TORCHHPC_SITE_PROFILE=\"$TORCHHPC_SITE_PROFILE\""
  printf '%s\n' "$body"
  echo "# Huge pages for torch's CPU tensors >= 2 MiB (docs/accl.md, \"Huge pages for CPU tensors\"): unless set"
  echo "# (THP_MEM_ALLOC_ENABLE=0 opts out) or the kernel's THP mode on this node is never (it would do nothing)."
  echo "if [ -z \"\${THP_MEM_ALLOC_ENABLE+x}\" ]; then"
  echo "  case \"\$(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)\" in"
  echo "    *\"[always]\"* | *\"[madvise]\"*) THP_MEM_ALLOC_ENABLE=1; export THP_MEM_ALLOC_ENABLE ;;"
  echo "  esac"
  echo "fi"
} >"$dir/activate.sh.tmp"
mv "$dir/activate.sh.tmp" "$dir/activate.sh"
{
  echo "# Undo $dir/activate.sh (written by utils/write_activation_hook.sh; do not edit)."
  echo "for _torchhpc_n in ${names[*]}; do"
  echo "  if eval \"[ -n \\\"\\\${_TORCHHPC_OLD_\$_torchhpc_n+x}\\\" ]\"; then"
  echo "    eval \"export \$_torchhpc_n=\\\"\\\${_TORCHHPC_OLD_\$_torchhpc_n}\\\"; unset _TORCHHPC_OLD_\$_torchhpc_n\""
  echo "  else"
  echo "    unset \"\$_torchhpc_n\""
  echo "  fi"
  echo "done"
  echo "unset _torchhpc_n _TORCHHPC_HOOK_ACTIVE"
} >"$dir/deactivate.sh.tmp"
mv "$dir/deactivate.sh.tmp" "$dir/deactivate.sh"

if [[ "$kind" == conda ]]; then
  mkdir -p "$prefix/etc/conda/activate.d" "$prefix/etc/conda/deactivate.d"
  printf '. "%s/activate.sh"\n' "$dir" >"$prefix/etc/conda/activate.d/torchhpc.sh"
  printf '. "%s/deactivate.sh"\n' "$dir" >"$prefix/etc/conda/deactivate.d/torchhpc.sh"
else
  activate="$prefix/bin/activate"
  [[ -f "$activate" ]] || die "$activate not found (not a venv?)"
  if ! grep -q '^# >>> torchhpc site hook >>>' "$activate"; then
    cat >>"$activate" <<'BLOCK'
# >>> torchhpc site hook >>>
# Site runtime settings (utils/write_activation_hook.sh). Under bash, `deactivate` also restores them.
if [ -f "$VIRTUAL_ENV/etc/torchhpc/activate.sh" ]; then
  . "$VIRTUAL_ENV/etc/torchhpc/activate.sh"
  if [ -n "${BASH_VERSION:-}" ]; then
    eval "_torchhpc_venv_deactivate() $(declare -f deactivate | sed 1d)"
    deactivate() {
      if [ -n "${_TORCHHPC_HOOK_ACTIVE:-}" ]; then . "$VIRTUAL_ENV/etc/torchhpc/deactivate.sh"; fi
      _torchhpc_venv_deactivate "$@"
      if [ "${1:-}" != nondestructive ]; then unset -f _torchhpc_venv_deactivate; fi
    }
  fi
fi
# <<< torchhpc site hook <<<
BLOCK
  fi
fi
echo "activation hook for site '$TORCHHPC_SITE' written to $dir (${#names[@]} variables)"
