#!/usr/bin/env bash
# Look up one PyTorch release in utils/pytorch_versions.tsv.
#   utils/pytorch_version.sh VERSION FIELD   -> prints that field (torchvision, cuda, cudnn, nccl, python, patches)
#   utils/pytorch_version.sh --list          -> prints the supported torch versions, one a line
#   utils/pytorch_version.sh --latest        -> prints the newest supported torch version
#   utils/pytorch_version.sh --table         -> prints the table aligned (commit shortened), then where it comes from
#   utils/pytorch_version.sh --sources [V]   -> prints utils/pytorch_versions.sources.tsv (only release V if given)
# Fails with a message naming the supported versions when VERSION is not in the table.
set -euo pipefail
table="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/pytorch_versions.tsv"
[[ -r "$table" ]] || { echo "pytorch_version.sh: cannot read $table" >&2; exit 1; }

sources="${table%.tsv}.sources.tsv"
rows() { awk -F'\t' '!/^#/ && NF && $1 != "torch"' "$table"; }
known() { rows | cut -f1 | tr '\n' ' '; }

case "${1:-}" in
  --list) rows | cut -f1; exit 0 ;;
  --latest) rows | cut -f1 | sort -V | tail -n1; exit 0 ;;
  --table)
    awk -F'\t' '!/^#/ && NF { c = $NF; if ($1 != "torch") c = substr(c, 1, 12)
      printf "%-7s %-11s %-5s %-5s %-7s %-6s %-8s %-12s %-14s %-5s %-7s %s\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, c }' "$table"
    printf '\nWhere each figure comes from (utils/pytorch_version.sh --sources VERSION for one release):\n'
    awk -F'\t' '!/^#/ && NF && $1 != "torch" { n[$2 "\t" $4]++ }
      END { for (k in n) { split(k, a, "\t"); printf "  %-13s %s\n", a[1], a[2] } }' "$sources" | sort | uniq
    exit 0 ;;
  --sources)
    if [[ -n "${2:-}" ]]; then
      v=${2#v}
      rows | cut -f1 | grep -qxF "$v" || { echo "pytorch_version.sh: PyTorch $v is not supported; supported: $(known)" >&2; exit 1; }
      awk -F'\t' -v v="$v" '$1 == v { printf "%-13s %-42s %s\n", $2, $3, $4 }' "$sources"
    else
      grep -v '^#' "$sources"
    fi
    exit 0 ;;
  "" | -h | --help) sed -n '2,8s/^# \{0,1\}//p' "$0"; exit 2 ;;
esac

version=${1#v}
field=${2:?"usage: pytorch_version.sh VERSION FIELD"}
col=$(awk -F'\t' -v f="$field" '$1 == "torch" { for (i = 1; i <= NF; i++) if ($i == f) print i }' "$table")
[[ -n "$col" ]] || { echo "pytorch_version.sh: unknown field '$field' (columns: $(grep -m1 '^torch' "$table" | tr '\t' ' '))" >&2; exit 1; }
value=$(rows | awk -F'\t' -v v="$version" -v c="$col" '$1 == v { print $c }')
if [[ -z "$value" ]]; then
  echo "pytorch_version.sh: PyTorch $version is not supported; supported: $(known)(see $table)" >&2
  exit 1
fi
printf '%s\n' "$value"
