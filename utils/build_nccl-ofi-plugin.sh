#!/usr/bin/env bash
# Build NCCL and the AWS OFI NCCL plugin (libnccl-net.so) against the site's CUDA and libfabric.
# Called by `make nccl-ofi` (and before every `make build-pytorch-vX.Y.Z`).
#
#   [SITE=...] [PYTORCH_VERSION=X.Y.Z] [NCCL_VERSION_OVERRIDE=2.21.5] [AWS_OFI_NCCL_VERSION=1.6.0] \
#     [NCCL_HOME=<existing NCCL>] [AWS_OFI_NCCL_SOURCES=<dir of aws-ofi-nccl-X.Y.Z.tar.gz>] \
#     [LIBFABRIC_ROOT=...] [HWLOC_ROOT=...] [DRY_RUN=1] utils/build_nccl-ofi-plugin.sh
#
# Versions are pinned: NCCL from utils/pytorch_versions.tsv (the NCCL that PyTorch release ships with),
# the plugin by AWS_OFI_NCCL_VERSION (tag AWS_OFI_NCCL_TAG, default v<version>).  NCCL is built from source
# into $NCCL_OFI_PREFIX (lib/, include/: the paths config_env.sh hands to PyTorch) unless NCCL_HOME names an
# existing NCCL (include/nccl.h, lib/libnccl.so*), which is then used as it is.  The plugin source is
# $AWS_OFI_NCCL_SOURCES/aws-ofi-nccl-<version>.tar.gz when that exists, else a clone of the tag; it installs
# into $NCCL_OFI_PREFIX/plugin (lib/libnccl-net.so), which the activation hook puts on LD_LIBRARY_PATH,
# and carries rpaths to libfabric and CUDA, so it loads in jobs without extra modules.
#
# What the plugin needs is read from its own configure.ac/m4 before anything is built, and a missing piece
# fails here with its name (see docs/cluster.md for 1.6.0 and 1.21.1): autoconf/automake/libtool; libfabric
# headers at the floor its configure checks; CUDA headers (cuda_runtime.h with crt/, and cuda.h where used)
# and cudart (libcudart.so, or libcudart_static.a for releases that link it statically); hwloc and a C++20
# compiler where configure asks for them.  The plugin bundles NCCL's net headers: NCCL is not a build input.
set -euo pipefail
# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

AWS_OFI_NCCL_VERSION=${AWS_OFI_NCCL_VERSION:-1.6.0}
AWS_OFI_NCCL_TAG=${AWS_OFI_NCCL_TAG:-v$AWS_OFI_NCCL_VERSION}
NCCL_GIT=${NCCL_GIT:-https://github.com/NVIDIA/nccl.git}
AWS_OFI_NCCL_GIT=${AWS_OFI_NCCL_GIT:-https://github.com/aws/aws-ofi-nccl.git}
TORCHHPC_NO_ENV=1 load_config

if [[ "$USE_CUDA" != 1 ]]; then
  echo "build_nccl-ofi-plugin.sh: no CUDA toolkit in site '$TORCHHPC_SITE' (USE_CUDA=0): NCCL is not built"
  exit 0
fi

# "8.0;9.0" -> -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90; "+PTX" adds PTX
gencode=""
for arch in ${TORCH_CUDA_ARCH_LIST//;/ }; do
  sm=${arch%+PTX}
  sm=${sm//./}
  gencode+="-gencode=arch=compute_$sm,code=sm_$sm "
  [[ "$arch" == *+PTX ]] && gencode+="-gencode=arch=compute_$sm,code=compute_$sm "
done
gencode=${gencode% }
fabric_root=${LIBFABRIC_ROOT:-$TORCHHPC_LIBFABRIC_ROOT}
hwloc_root=${HWLOC_ROOT:-/usr}
fabric_lib="$fabric_root/lib64"
[[ -d "$fabric_lib" || ! -d "$fabric_root/lib" ]] || fabric_lib="$fabric_root/lib"
cuda_lib="$CUDA_HOME/lib64"
[[ -d "$cuda_lib" || ! -d "$CUDA_HOME/lib" ]] || cuda_lib="$CUDA_HOME/lib"
src_root="$TORCHHPC_PREFIX/src"
nccl_src="$src_root/nccl-$NCCL_VERSION"
ofi_src="$src_root/aws-ofi-nccl-$AWS_OFI_NCCL_VERSION"
ofi_archive="${AWS_OFI_NCCL_SOURCES:-}/aws-ofi-nccl-$AWS_OFI_NCCL_VERSION.tar.gz"
plugin="$NCCL_OFI_PREFIX/plugin"
nccl_home=${NCCL_HOME:-}

step "configuration (site $TORCHHPC_SITE)"
print_vars NCCL_VERSION AWS_OFI_NCCL_VERSION AWS_OFI_NCCL_TAG NCCL_OFI_PREFIX NCCL_HOME CUDA_HOME \
  TORCHHPC_LIBFABRIC_ROOT LIBFABRIC_ROOT HWLOC_ROOT TORCHHPC_GDRCOPY_ROOT TORCH_CUDA_ARCH_LIST MAX_JOBS
echo "NVCC_GENCODE=$gencode"

step "NCCL $NCCL_VERSION"
nccl_key="$NCCL_VERSION $gencode $CUDA_HOME $nccl_home"
if [[ -n "$nccl_home" ]]; then
  # An existing NCCL (a site module, or the nvidia-nccl-cu12 wheel in CI): linked into the prefix as is.
  [[ -e "$nccl_home/include/nccl.h" ]] || die "NCCL_HOME=$nccl_home has no include/nccl.h"
  compgen -G "$nccl_home/lib/libnccl.so*" >/dev/null || die "NCCL_HOME=$nccl_home has no lib/libnccl.so*"
  have=$(for part in MAJOR MINOR PATCH; do sed -n "s/^#define NCCL_$part \([0-9]*\).*/\1/p" "$nccl_home/include/nccl.h"; done | paste -sd. -)
  [[ "$have" == "$NCCL_VERSION" ]] \
    || die "NCCL_HOME=$nccl_home holds NCCL $have, but PyTorch $PYTORCH_VERSION is pinned to NCCL $NCCL_VERSION: use NCCL_VERSION_OVERRIDE=$have to build against it deliberately"
  run mkdir -p "$NCCL_OFI_PREFIX/lib" "$NCCL_OFI_PREFIX/include"
  for f in "$nccl_home"/include/nccl*.h "$nccl_home"/lib/libnccl.so*; do
    [[ "$f" == */include/* ]] && dest="$NCCL_OFI_PREFIX/include" || dest="$NCCL_OFI_PREFIX/lib"
    run ln -sfn "$(readlink -f "$f")" "$dest/$(basename "$f")"
  done
  [[ -e "$nccl_home/lib/libnccl.so" ]] || run ln -sfn libnccl.so.2 "$NCCL_OFI_PREFIX/lib/libnccl.so"
elif stamp_ok "nccl-$NCCL_VERSION-$TORCHHPC_SITE" "$nccl_key"; then
  echo "already installed in $NCCL_OFI_PREFIX"
else
  run rm -rf "$nccl_src"
  run mkdir -p "$src_root"
  run git clone --branch "v$NCCL_VERSION-1" --depth 1 "$NCCL_GIT" "$nccl_src"
  run make -C "$nccl_src" -j "$MAX_JOBS" src.build CUDA_HOME="$CUDA_HOME" NVCC_GENCODE="$gencode" \
    PREFIX="$NCCL_OFI_PREFIX"
  run make -C "$nccl_src" install PREFIX="$NCCL_OFI_PREFIX"
  stamp_write "nccl-$NCCL_VERSION-$TORCHHPC_SITE" "$nccl_key"
fi

# require WHAT HINT TEST...: die naming WHAT (and how to get it) unless the test command succeeds.
require() {
  local what=$1 hint=$2
  shift 2
  "$@" >/dev/null 2>&1 || die "aws-ofi-nccl $AWS_OFI_NCCL_VERSION needs $what: $hint"
}

# What this release's configure asks for, read from its source (ofi_src unpacked below).
check_plugin_inputs() {
  local ac="$ofi_src/configure.ac" m4="$ofi_src/m4" floor="" cxx_std="" cc
  require "autoconf, automake and libtool (its autogen.sh)" "apt-get install autoconf automake libtool" \
    command -v autoreconf libtoolize aclocal
  [[ -e "$fabric_root/include/rdma/fabric.h" ]] \
    || die "aws-ofi-nccl $AWS_OFI_NCCL_VERSION needs libfabric headers: no rdma/fabric.h under $fabric_root/include (apt-get install libfabric-dev, a site libfabric module, or LIBFABRIC_ROOT=<prefix>)"
  compgen -G "$fabric_lib/libfabric.so*" >/dev/null || compgen -G "/usr/lib/*/libfabric.so" >/dev/null \
    || die "aws-ofi-nccl $AWS_OFI_NCCL_VERSION needs libfabric.so: none in $fabric_lib"
  floor=$(grep -ho 'FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), FI_VERSION([0-9]*,[0-9]*)' \
            "$m4/check_pkg_libfabric.m4" 2>/dev/null | sed 's/.*FI_VERSION(\([0-9]*\),\([0-9]*\))$/\1.\2/' | head -n 1 || true)
  if [[ -n "$floor" ]]; then
    local have
    have=$(printf '%s.%s' "$(sed -n 's/^#define FI_MAJOR_VERSION \([0-9]*\).*/\1/p' "$fabric_root/include/rdma/fabric.h")" \
                          "$(sed -n 's/^#define FI_MINOR_VERSION \([0-9]*\).*/\1/p' "$fabric_root/include/rdma/fabric.h")")
    [[ "$(printf '%s\n%s\n' "$floor" "$have" | sort -V | head -n 1)" == "$floor" ]] \
      || die "aws-ofi-nccl $AWS_OFI_NCCL_VERSION needs libfabric >= $floor; $fabric_root has $have (LIBFABRIC_ROOT=<newer prefix>)"
    echo "libfabric $have at $fabric_root (configure's floor: $floor)"
  fi
  require "CUDA headers: cuda_runtime.h and the crt/ headers it includes under $CUDA_HOME/include" \
    "a CUDA toolkit (CUDA_HOME=...), or in CI the nvidia-cuda-runtime-cu12 + nvidia-cuda-nvcc-cu12 wheels (make nccl-ofi-inputs)" \
    test -e "$CUDA_HOME/include/cuda_runtime.h" -a -e "$CUDA_HOME/include/crt/host_config.h"
  if grep -q 'include <cuda.h>' "$m4/check_pkg_cuda.m4"; then
    require "the CUDA driver API header cuda.h under $CUDA_HOME/include" "a CUDA toolkit >= 11.3" \
      test -e "$CUDA_HOME/include/cuda.h"
  fi
  if grep -q 'cudart_static' "$m4/check_pkg_cuda.m4"; then
    require "the static CUDA runtime $cuda_lib/libcudart_static.a (this release links cudart statically)" \
      "a CUDA toolkit, or the nvidia-cuda-runtime-cu12 wheel; note configure reads <CUDA_HOME>/lib64" \
      test -e "$CUDA_HOME/lib64/libcudart_static.a"
  else
    require "the CUDA runtime $cuda_lib/libcudart.so" "a CUDA toolkit (the unversioned libcudart.so link too)" \
      test -e "$cuda_lib/libcudart.so"
  fi
  if grep -q 'CHECK_PKG_HWLOC' "$ac"; then
    require "hwloc (hwloc.h and libhwloc under $hwloc_root)" "apt-get install libhwloc-dev, a site hwloc module, or HWLOC_ROOT=<prefix>" \
      test -e "$hwloc_root/include/hwloc.h"
  fi
  cxx_std=$(sed -n 's/.*AX_CXX_COMPILE_STDCXX(\[\([0-9]*\)\].*/\1/p' "$ac" | head -n 1 || true)
  if [[ -n "$cxx_std" ]]; then
    cc=${CXX:-g++}
    require "a C++$cxx_std compiler ($cc -std=c++$cxx_std failed)" "gcc >= 10 or clang >= 10 (CXX=...)" \
      bash -c "echo 'int main(){}' | $(printf '%q' "$cc") -std=c++$cxx_std -x c++ - -o /dev/null"
  fi
}

step "aws-ofi-nccl $AWS_OFI_NCCL_VERSION (libfabric $fabric_root)"
ofi_key="$AWS_OFI_NCCL_TAG $nccl_key $fabric_root $hwloc_root"
if stamp_ok "aws-ofi-nccl-$AWS_OFI_NCCL_VERSION-$TORCHHPC_SITE" "$ofi_key" && [[ -e "$plugin/lib/libnccl-net.so" ]]; then
  echo "already installed in $plugin"
else
  run rm -rf "$ofi_src"
  run mkdir -p "$src_root"
  if [[ -f "$ofi_archive" ]]; then
    run mkdir -p "$ofi_src"
    run tar -xzf "$ofi_archive" -C "$ofi_src" --strip-components=1
    # A `git archive` snapshot has no .git, from which 1.19+ take their version (m4/get_version.sh).
    [[ "$DRY_RUN" == 1 ]] || printf '%s\n' "$AWS_OFI_NCCL_VERSION" >"$ofi_src/.release_version"
  else
    run git clone --branch "$AWS_OFI_NCCL_TAG" --depth 1 "$AWS_OFI_NCCL_GIT" "$ofi_src"
  fi
  [[ "$DRY_RUN" == 1 ]] || check_plugin_inputs
  # Flags as the release's configure.ac defines them (neither 1.6.0 nor 1.21.1 has --with-nccl: both carry
  # NCCL's net headers).  A prefix of /usr is left to the compiler's default search: configure turns
  # --with-X=/usr into `-isystem /usr/include`, which breaks C++'s #include_next <stdlib.h>.
  configure=(./configure --prefix="$plugin" --with-cuda="$CUDA_HOME" --disable-tests)
  [[ "$fabric_root" == /usr ]] || configure+=(--with-libfabric="$fabric_root")
  [[ "$hwloc_root" == /usr ]] || configure+=(--with-hwloc="$hwloc_root")
  [[ -e "$TORCHHPC_GDRCOPY_ROOT/include/gdrapi.h" ]] && configure+=(--with-gdrcopy="$TORCHHPC_GDRCOPY_ROOT")
  rpath="-Wl,-rpath,$fabric_lib -Wl,-rpath,$cuda_lib"
  run_in "$ofi_src" ./autogen.sh
  run_in "$ofi_src" env LDFLAGS="$rpath" "${configure[@]}"
  run make -C "$ofi_src" -j "$MAX_JOBS"
  run make -C "$ofi_src" install
  stamp_write "aws-ofi-nccl-$AWS_OFI_NCCL_VERSION-$TORCHHPC_SITE" "$ofi_key"
fi

step "check"
if [[ "$DRY_RUN" != 1 ]]; then
  compgen -G "$NCCL_OFI_PREFIX/lib/libnccl.so*" >/dev/null || die "NCCL library missing from $NCCL_OFI_PREFIX/lib"
  [[ -e "$plugin/lib/libnccl-net.so" ]] || die "plugin libnccl-net.so missing from $plugin/lib"
  if ldd "$plugin/lib/libnccl-net.so" | grep 'not found'; then die "the plugin has unresolved libraries (above)"; fi
  echo "NCCL $NCCL_VERSION + aws-ofi-nccl $AWS_OFI_NCCL_VERSION installed in $NCCL_OFI_PREFIX"
  echo "exported plugin symbols: $(nm -D --defined-only "$plugin/lib/libnccl-net.so" | awk '/ncclNetPlugin_v/ {print $3}' | sort -V | paste -sd' ' -)"
fi
