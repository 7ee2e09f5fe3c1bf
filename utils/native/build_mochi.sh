#!/usr/bin/env bash
# `make native-mochi`: build the Mochi stack (Argobots, Mercury, Margo, Thallium) at the versions pinned in
# utils/native_versions.tsv into NATIVE_PREFIX, then the Thallium transport of torchhpc.rehearsal
# (pybind11 module _torchhpc_thallium).  Inputs: see utils/native/common.sh.  Flags follow what was
# checked to build on Debian 12 (Mercury needs its Boost preprocessor option, else Margo fails on
# MERCURY_GEN_PROC).  Re-running only redoes what changed.
set -euo pipefail
# shellcheck source=utils/native/common.sh
source "$(dirname "$0")/common.sh"

native_require \
  autoconf:cmd=autoconf:autoconf automake:cmd=automake:automake libtool:cmd=libtoolize:libtool \
  cmake:cmd=cmake:cmake pkg-config:cmd=pkg-config:pkg-config "C++ compiler:cmd=${CXX:-c++}:build-essential" \
  json-c:h=json-c/json.h:libjson-c-dev cereal:h=cereal/cereal.hpp:libcereal-dev \
  boost:h=boost/preprocessor.hpp:libboost-dev libfabric:pc=libfabric:libfabric-dev

build_argobots() {
  run ./autogen.sh
  run ./configure --prefix="$NATIVE_PREFIX" --enable-shared --disable-static
  run make -j "$NATIVE_JOBS"
  run make install
}

build_mercury() {
  native_cmake -DBUILD_SHARED_LIBS=ON -DNA_USE_OFI=ON -DNA_USE_SM=ON -DMERCURY_USE_CHECKSUMS=OFF \
    -DMERCURY_USE_BOOST_PP=ON -DMERCURY_USE_SYSTEM_BOOST=ON -DBUILD_TESTING=OFF
}

build_margo() { native_cmake -DBUILD_SHARED_LIBS=ON -DENABLE_TESTS=OFF; }

build_thallium() { native_cmake -DENABLE_TESTS=OFF -DENABLE_EXAMPLES=OFF; }

# A library's stamp also names the stamps it was built against, so a rebuilt dependency rebuilds it.
dep_stamps() { local n; for n in "$@"; do cat "$NATIVE_PREFIX/stamps/$n" 2>/dev/null || echo "$n:none"; done | sha256sum | cut -c1-12; }

native_build argobots "" build_argobots
native_build mercury "boost_pp=on" build_mercury
native_build margo "deps=$(dep_stamps argobots mercury)" build_margo
native_build thallium "deps=$(dep_stamps margo)" build_thallium

# The extension: thallium is header-only; it links Margo, Mercury, Argobots through pkg-config.
flags=$(pkg-config --cflags --libs thallium 2>/dev/null || pkg-config --cflags --libs margo)
native_extension _torchhpc_thallium "src/torchhpc/rehearsal/native/thallium_transport.cpp" \
  "-I$NATIVE_PREFIX/include $flags" "deps=$(dep_stamps thallium)"
