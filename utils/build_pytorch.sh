#!/usr/bin/env bash
# Build PyTorch vX.Y.Z from source with our patches, then the matching torchvision, into the site's build
# environment (created by config_env.sh).  Called by `make build-pytorch-vX.Y.Z`.
#
#   PYTORCH_VERSION=2.5.1 [SITE=derecho] [DRY_RUN=1] [STOP_AFTER=step] utils/build_pytorch.sh
#
# Steps (each skipped when its stamp says it is done): clone at the tag; apply
# patches/pytorch/vX.Y.Z/*.patch in file-name order; update submodules; install the build requirements;
# build a wheel (PYTORCH_BUILD_VERSION=X.Y.Z+torchhpc.<site>); install it; the same for torchvision; check
# that the installed torch has the MPI backend (and NCCL/CUDA when built with CUDA).
# STOP_AFTER=clone|patches|submodules|requirements|wheel|install|torchvision ends the build after that step
# (e.g. STOP_AFTER=patches to read the patched tree).
set -euo pipefail
# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

: "${PYTORCH_VERSION:?set PYTORCH_VERSION=X.Y.Z (see utils/pytorch_versions.tsv)}"
PYTORCH_GIT=${PYTORCH_GIT:-https://github.com/pytorch/pytorch.git}
TORCHVISION_GIT=${TORCHVISION_GIT:-https://github.com/pytorch/vision.git}
STOP_AFTER=${STOP_AFTER:-}
case "$STOP_AFTER" in
  "" | clone | patches | submodules | requirements | wheel | install | torchvision) ;;
  *) die "STOP_AFTER='$STOP_AFTER' is not a step (clone patches submodules requirements wheel install torchvision)" ;;
esac
done_step() {
  if [[ "$1" == "$STOP_AFTER" ]]; then
    echo "STOP_AFTER=$STOP_AFTER: stopping here"
    exit 0
  fi
}
TORCHHPC_CREATE_ENV=1 load_config  # the build makes its environment, in its job too

version=$PYTORCH_VERSION
src_root="$TORCHHPC_PREFIX/src"
src="$src_root/pytorch-v$version"
vision_src="$src_root/vision-v$TORCHVISION_VERSION"
wheels="$TORCHHPC_PREFIX/wheels/$TORCHHPC_SITE"
[[ -d "$TORCHHPC_PATCH_DIR" ]] || die "no patch directory $TORCHHPC_PATCH_DIR for PyTorch $version"
mapfile -t patches < <(find "$TORCHHPC_PATCH_DIR" -maxdepth 1 -name '*.patch' | LC_ALL=C sort)
((${#patches[@]})) || die "no *.patch files in $TORCHHPC_PATCH_DIR"
patch_sum=$(cat "${patches[@]}" | sha256sum | cut -c1-16)

step "configuration (site $TORCHHPC_SITE)"
print_vars TORCHHPC_SITE TORCHHPC_SITE_PROFILE TORCHHPC_SITE_MODULES PYTORCH_VERSION TORCHVISION_VERSION \
  PYTORCH_BUILD_VERSION USE_CUDA USE_CUDNN USE_MPI USE_DISTRIBUTED USE_SYSTEM_NCCL NCCL_ROOT NCCL_LIB_DIR \
  NCCL_INCLUDE_DIR TORCH_CUDA_ARCH_LIST CUDA_HOME BLAS MAX_JOBS CMAKE_PREFIX_PATH CC CXX MPICC LDFLAGS \
  TORCHHPC_ENV_PREFIX
printf 'patch order: %s\n' "$(for p in "${patches[@]}"; do basename "$p"; done | paste -sd' ' -)"
table_cuda=$("$TORCHHPC_ROOT/utils/pytorch_version.sh" "$version" cuda)
table_cudnn=$("$TORCHHPC_ROOT/utils/pytorch_version.sh" "$version" cudnn)
echo "version table: PyTorch $version was released for CUDA $table_cuda, cuDNN $table_cudnn"
if [[ "$USE_CUDA" == 1 && "${CUDA_MISMATCH_OK:-0}" != 1 && "$DRY_RUN" != 1 ]]; then
  unfit=$(cuda_unfit "$version")
  [[ -z "$unfit" ]] || die "$unfit"
fi
if [[ "$USE_CUDA" == 1 ]]; then
  nvcc_version=$(nvcc_release "$CUDA_HOME")
  if [[ -n "$nvcc_version" && "${nvcc_version%%.*}" != "${table_cuda%%.*}" ]]; then
    echo "warning: CUDA here is $nvcc_version, PyTorch $version was released for CUDA $table_cuda" >&2
  fi
fi

if [[ "$USE_SYSTEM_NCCL" == 1 && "$DRY_RUN" != 1 && ! -e "$NCCL_LIB_DIR/libnccl.so" ]]; then
  die "USE_SYSTEM_NCCL=1 but $NCCL_LIB_DIR/libnccl.so is missing: run 'make nccl-ofi' first"
fi

step "source: PyTorch v$version"
if stamp_ok "pytorch-v$version.clone" "v$version"; then
  echo "already cloned: $src"
else
  run rm -rf "$src"
  run mkdir -p "$src_root"
  run git clone --branch "v$version" --depth 1 --shallow-submodules "$PYTORCH_GIT" "$src"
  stamp_write "pytorch-v$version.clone" "v$version"
fi
done_step clone

step "patches: ${#patches[@]} from $TORCHHPC_PATCH_DIR"
if stamp_ok "pytorch-v$version.patches" "$patch_sum"; then
  echo "already applied (patch set $patch_sum)"
else
  if [[ "$DRY_RUN" != 1 && -f "$TORCHHPC_PREFIX/stamps/pytorch-v$version.patches" ]]; then
    die "the patch set changed since $src was patched: run 'make clean-pytorch-v$version' and build again"
  fi
  for p in "${patches[@]}"; do
    run_in "$src" git apply --check --verbose "$p"
    run_in "$src" git apply "$p"
  done
  stamp_write "pytorch-v$version.patches" "$patch_sum"
fi
done_step patches

step "submodules"
if stamp_ok "pytorch-v$version.submodules" "v$version"; then
  echo "already updated"
else
  run_in "$src" git submodule sync --recursive
  run_in "$src" git submodule update --init --recursive --depth 1 --jobs 8
  stamp_write "pytorch-v$version.submodules" "v$version"
fi
done_step submodules

step "build requirements"
reqs=(-r requirements.txt)
[[ "$BLAS" == MKL ]] && reqs+=(mkl-static mkl-include)
if stamp_ok "pytorch-v$version.requirements" "$TORCHHPC_ENV_PREFIX"; then
  echo "already installed"
else
  run_in "$src" python -m pip install --upgrade "${reqs[@]}"
  stamp_write "pytorch-v$version.requirements" "$TORCHHPC_ENV_PREFIX"
fi
done_step requirements

step "wheel: torch $PYTORCH_BUILD_VERSION"
build_key="$PYTORCH_BUILD_VERSION $patch_sum USE_CUDA=$USE_CUDA arch=$TORCH_CUDA_ARCH_LIST nccl=$NCCL_ROOT"
if stamp_ok "pytorch-v$version.wheel" "$build_key"; then
  echo "already built"
else
  run mkdir -p "$wheels"
  run_in "$src" python setup.py bdist_wheel --dist-dir "$wheels"
  stamp_write "pytorch-v$version.wheel" "$build_key"
fi
done_step wheel

step "install torch into $TORCHHPC_ENV_PREFIX"
if stamp_ok "pytorch-v$version.install" "$build_key $TORCHHPC_ENV_PREFIX"; then
  echo "already installed"
else
  run python -m pip install --force-reinstall --no-deps --no-index --find-links "$wheels" \
    "torch==$PYTORCH_BUILD_VERSION"
  stamp_write "pytorch-v$version.install" "$build_key $TORCHHPC_ENV_PREFIX"
fi
done_step install

step "torchvision v$TORCHVISION_VERSION"
vision_key="$BUILD_VERSION $build_key"
if stamp_ok "vision-v$TORCHVISION_VERSION.install" "$vision_key $TORCHHPC_ENV_PREFIX"; then
  echo "already installed"
else
  run rm -rf "$vision_src"
  run git clone --branch "v$TORCHVISION_VERSION" --depth 1 "$TORCHVISION_GIT" "$vision_src"
  run_in "$vision_src" python setup.py bdist_wheel --dist-dir "$wheels"
  run python -m pip install --force-reinstall --no-deps --no-index --find-links "$wheels" \
    "torchvision==$BUILD_VERSION"
  stamp_write "vision-v$TORCHVISION_VERSION.install" "$vision_key $TORCHHPC_ENV_PREFIX"
fi
done_step torchvision

step "check"
run python "$TORCHHPC_ROOT/utils/check_torch_build.py" --torch-version "$PYTORCH_BUILD_VERSION" \
  --torchvision-version "$BUILD_VERSION" --cuda "$USE_CUDA"
