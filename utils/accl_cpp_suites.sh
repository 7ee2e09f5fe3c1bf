#!/usr/bin/env bash
# Every accl suite on the C++ backend (issue 24; docs/accl-cpp-status.md), as the harness launches them
# (plain `mpiexec -n N`, --oversubscribe when cores are short), each file at its rank counts, then under the
# MPICH wheel where the file asks for it.  The suites' assertions are the ones the Python adapter passes.
#
#   utils/accl_cpp_suites.sh [VENV]        (default: .venv; builds the backend for both MPI families first)
#
# Deselected (documented in docs/accl-cpp-status.md): the three conformance tests that spy on the Python
# adapter's private `_submit`.  Ends non-zero when any job failed; prints one line per job.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$root/.venv}
py=$venv/bin/python
export PYTHONPATH=$root/src:$root/tests${PYTHONPATH:+:$PYTHONPATH}
export TORCHHPC_ACCL_IMPL=cpp OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cd "$root" || exit 2

"$py" -m torchhpc.accl.corebuild --backend only >/dev/null || exit 2
if [[ -x $venv/mpich/bin/mpicc ]]; then
  "$py" -m torchhpc.accl.corebuild --backend only --mpicc "$venv/mpich/bin/mpicc" >/dev/null || exit 2
fi

failed=0
run() {  # run NP FILE [pytest args...]: one job under Open MPI
  local np=$1 file=$2 log
  shift 2
  log=$(mktemp)
  if timeout 600 "$venv/bin/mpiexec" --oversubscribe -n "$np" -x PYTHONPATH -x TORCHHPC_ACCL_IMPL \
      "$py" -m pytest -q -x -p no:cacheprovider --capture=sys "$file" "$@" >"$log" 2>&1; then
    echo "ok    np=$np $file $(grep -a -o '[0-9]* passed' "$log" | head -1)"
  else
    echo "FAIL  np=$np $file (log: $log)"
    failed=1
    return
  fi
  rm -f "$log"
}
variant() {  # variant NAME NP FILE: the harness's own launch (tests/_mpijob.py) for a variant
  local name=$1 np=$2 file=$3 log
  log=$(mktemp)
  if timeout 600 "$py" tests/_mpijob.py -n "$np" --variant "$name" "$file" >"$log" 2>&1; then
    echo "ok    np=$np --variant $name $file"
  else
    echo "FAIL  np=$np --variant $name $file (log: $log)"
    failed=1
    return
  fi
  rm -f "$log"
}

spies="not sync_fast_paths and not take_the_queue and not behind_async"
for np in 2 4; do run "$np" tests/mpi/test_accl_conformance.py -k "$spies"; done
for np in 2 4; do run "$np" tests/mpi/test_accl_async_errors.py; done
for np in 2 3 4; do run "$np" tests/mpi/test_accl_groups.py; done
for np in 2 4; do run "$np" tests/mpi/test_accl_training.py; done
for np in 2 4; do run "$np" tests/mpi/test_accl_engine.py; done
for np in 2 3; do run "$np" tests/mpi/test_workloads_ddp.py; done
run 4 tests/mpi/test_workloads_mesh.py
for np in 2 3; do run "$np" tests/mpi/test_accl_cpp.py; done
variant mpich 4 tests/mpi/test_accl_groups.py
variant mpich 4 tests/mpi/test_accl_async_errors.py
variant rank-order 4 tests/mpi/test_accl_groups.py
log=$(mktemp)
if timeout 900 "$py" -m pytest -q -p no:cacheprovider tests/test_accl_peer_death.py tests/test_accl_backend.py \
    >"$log" 2>&1; then
  echo "ok    tests/test_accl_peer_death.py tests/test_accl_backend.py $(grep -a -o '[0-9]* passed' "$log" | head -1)"
  rm -f "$log"
else
  echo "FAIL  tests/test_accl_peer_death.py tests/test_accl_backend.py (log: $log)"
  failed=1
fi
exit "$failed"
