#!/usr/bin/env bash
# Look up one PyTorch release in utils/pytorch_versions.tsv.
#   utils/pytorch_version.sh VERSION FIELD   -> prints that field (torchvision, cuda, cudnn, nccl, python, patches)
#   utils/pytorch_version.sh --list          -> prints the supported torch versions, one a line
#   utils/pytorch_version.sh --latest        -> prints the newest supported torch version
# Fails with a message naming the supported versions when VERSION is not in the table.
set -euo pipefail
table="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/pytorch_versions.tsv"
[[ -r "$table" ]] || { echo "pytorch_version.sh: cannot read $table" >&2; exit 1; }

rows() { awk -F'\t' '!/^#/ && NF && $1 != "torch"' "$table"; }

case "${1:-}" in
  --list) rows | cut -f1; exit 0 ;;
  --latest) rows | cut -f1 | sort -V | tail -n1; exit 0 ;;
  "" | -h | --help) sed -n '2,6s/^# \{0,1\}//p' "$0"; exit 2 ;;
esac

version=${1#v}
field=${2:?"usage: pytorch_version.sh VERSION FIELD"}
col=$(awk -F'\t' -v f="$field" '$1 == "torch" { for (i = 1; i <= NF; i++) if ($i == f) print i }' "$table")
[[ -n "$col" ]] || { echo "pytorch_version.sh: unknown field '$field' (columns: $(grep -m1 '^torch' "$table" | tr '\t' ' '))" >&2; exit 1; }
value=$(rows | awk -F'\t' -v v="$version" -v c="$col" '$1 == v { print $c }')
if [[ -z "$value" ]]; then
  echo "pytorch_version.sh: PyTorch $version is not supported; supported: $(rows | cut -f1 | tr '\n' ' ')(see $table)" >&2
  exit 1
fi
printf '%s\n' "$value"
