#!/usr/bin/env bash
# Build NCCL and the AWS OFI NCCL plugin (libnccl-net.so) against the site's CUDA and libfabric.
# Called by `make nccl-ofi` (and before every `make build-pytorch-vX.Y.Z`).
#
#   [SITE=...] [PYTORCH_VERSION=X.Y.Z] [NCCL_VERSION_OVERRIDE=2.21.5] [AWS_OFI_NCCL_VERSION=1.6.0] \
#     [DRY_RUN=1] utils/build_nccl-ofi-plugin.sh
#
# Versions are pinned: NCCL from utils/pytorch_versions.tsv (the NCCL that PyTorch release ships with),
# the plugin by AWS_OFI_NCCL_VERSION (tag AWS_OFI_NCCL_TAG, default v<version>).  Installs into
# $NCCL_OFI_PREFIX (lib/, include/ for NCCL; plugin/lib/libnccl-net.so), the paths config_env.sh hands to
# PyTorch (NCCL_ROOT, NCCL_LIB_DIR, NCCL_INCLUDE_DIR) and the activation hook puts on LD_LIBRARY_PATH.
# The plugin carries rpaths to libfabric, CUDA and NCCL, so it loads in jobs without extra modules.
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
fabric_lib="$TORCHHPC_LIBFABRIC_ROOT/lib64"
[[ -d "$fabric_lib" || ! -d "$TORCHHPC_LIBFABRIC_ROOT/lib" ]] || fabric_lib="$TORCHHPC_LIBFABRIC_ROOT/lib"
src_root="$TORCHHPC_PREFIX/src"
nccl_src="$src_root/nccl-$NCCL_VERSION"
ofi_src="$src_root/aws-ofi-nccl-$AWS_OFI_NCCL_VERSION"
plugin="$NCCL_OFI_PREFIX/plugin"

step "configuration (site $TORCHHPC_SITE)"
print_vars NCCL_VERSION AWS_OFI_NCCL_VERSION AWS_OFI_NCCL_TAG NCCL_OFI_PREFIX CUDA_HOME \
  TORCHHPC_LIBFABRIC_ROOT TORCHHPC_GDRCOPY_ROOT TORCH_CUDA_ARCH_LIST MAX_JOBS
echo "NVCC_GENCODE=$gencode"

step "NCCL $NCCL_VERSION"
nccl_key="$NCCL_VERSION $gencode $CUDA_HOME"
if stamp_ok "nccl-$NCCL_VERSION-$TORCHHPC_SITE" "$nccl_key"; then
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

step "aws-ofi-nccl $AWS_OFI_NCCL_VERSION (libfabric $TORCHHPC_LIBFABRIC_ROOT)"
ofi_key="$AWS_OFI_NCCL_TAG $nccl_key $TORCHHPC_LIBFABRIC_ROOT"
if stamp_ok "aws-ofi-nccl-$AWS_OFI_NCCL_VERSION-$TORCHHPC_SITE" "$ofi_key"; then
  echo "already installed in $plugin"
else
  configure=(./configure --prefix="$plugin" --with-libfabric="$TORCHHPC_LIBFABRIC_ROOT"
             --with-cuda="$CUDA_HOME" --with-nccl="$NCCL_OFI_PREFIX" --disable-tests)
  [[ -e "$TORCHHPC_GDRCOPY_ROOT/include/gdrapi.h" ]] && configure+=(--with-gdrcopy="$TORCHHPC_GDRCOPY_ROOT")
  rpath="-Wl,-rpath,$fabric_lib -Wl,-rpath,$CUDA_HOME/lib64 -Wl,-rpath,$NCCL_OFI_PREFIX/lib"
  run rm -rf "$ofi_src"
  run git clone --branch "$AWS_OFI_NCCL_TAG" --depth 1 "$AWS_OFI_NCCL_GIT" "$ofi_src"
  run_in "$ofi_src" ./autogen.sh
  run_in "$ofi_src" env LDFLAGS="$rpath" "${configure[@]}"
  run make -C "$ofi_src" -j "$MAX_JOBS"
  run make -C "$ofi_src" install
  stamp_write "aws-ofi-nccl-$AWS_OFI_NCCL_VERSION-$TORCHHPC_SITE" "$ofi_key"
fi

step "check"
if [[ "$DRY_RUN" != 1 ]]; then
  [[ -e "$NCCL_OFI_PREFIX/lib/libnccl.so" ]] || die "NCCL library missing from $NCCL_OFI_PREFIX/lib"
  [[ -e "$plugin/lib/libnccl-net.so" ]] || die "plugin libnccl-net.so missing from $plugin/lib"
  if ldd "$plugin/lib/libnccl-net.so" | grep 'not found'; then die "the plugin has unresolved libraries (above)"; fi
  echo "NCCL $NCCL_VERSION + aws-ofi-nccl $AWS_OFI_NCCL_VERSION installed in $NCCL_OFI_PREFIX"
fi
