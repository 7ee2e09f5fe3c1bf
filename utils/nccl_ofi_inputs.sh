#!/usr/bin/env bash
# CI stand-ins for a cluster's CUDA toolkit and NCCL, so that `make nccl-ofi` can build aws-ofi-nccl for
# real on a machine without either: the pinned wheels of utils/nccl_ofi_inputs.txt, unpacked (headers and
# libraries only) into two prefixes laid out as the plugin's configure expects:
#
#   $NCCL_OFI_INPUTS/cuda   include/ (cuda_runtime.h, cuda.h, crt/), lib64/ (libcudart.so*, libcudart_static.a)
#   $NCCL_OFI_INPUTS/nccl   include/nccl.h, lib/libnccl.so.2
#
#   [PYTHON=.venv/bin/python] [NCCL_OFI_INPUTS=.venv/nccl-ofi-inputs] utils/nccl_ofi_inputs.sh
# Re-running with the same pins does nothing.  Then: make nccl-ofi CUDA_HOME=$NCCL_OFI_INPUTS/cuda
# NCCL_HOME=$NCCL_OFI_INPUTS/nccl (what tests/test_nccl_ofi_plugin.py does).
set -euo pipefail
# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$root/.venv/bin/python}
dest=${NCCL_OFI_INPUTS:-$root/.venv/nccl-ofi-inputs}
pins="$root/utils/nccl_ofi_inputs.txt"
mapfile -t wheels < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$pins")
[[ -x "$PYTHON" ]] || die "no $PYTHON: run 'make env' first"
if [[ -f "$dest/.pins" && "$(cat "$dest/.pins")" == "${wheels[*]}" ]]; then
  echo "nccl-ofi inputs already in $dest (${wheels[*]})"
  exit 0
fi
rm -rf "$dest"
mkdir -p "$dest/wheels" "$dest/cuda/include" "$dest/cuda/lib64" "$dest/nccl"
step "downloading ${wheels[*]}"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: -d "$dest/wheels" "${wheels[@]}"
step "unpacking headers and libraries into $dest"
"$PYTHON" - "$dest" <<'PY'
import pathlib, shutil, sys, zipfile
dest = pathlib.Path(sys.argv[1])
targets = {"cuda_runtime/include/": "cuda/include", "cuda_nvcc/include/": "cuda/include",
           "cuda_runtime/lib/": "cuda/lib64", "nccl/include/": "nccl/include", "nccl/lib/": "nccl/lib"}
for wheel in sorted((dest / "wheels").glob("*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            for prefix, where in targets.items():
                if name.startswith("nvidia/" + prefix) and not name.endswith(("/", "__init__.py")):
                    out = dest / where / name[len("nvidia/" + prefix):]
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with z.open(name) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst)
PY
ln -sfn libcudart.so.12 "$dest/cuda/lib64/libcudart.so"
ln -sfn libnccl.so.2 "$dest/nccl/lib/libnccl.so"
rm -rf "$dest/wheels"
printf '%s\n' "${wheels[*]}" >"$dest/.pins"
du -sh "$dest/cuda" "$dest/nccl"
