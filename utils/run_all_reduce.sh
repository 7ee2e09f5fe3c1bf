#!/usr/bin/env bash
# Inside a PBS job (submitted by `make test-pbs`): run tests/all_reduce_test.py on every node of the job,
# one rank per GPU, once per backend, and print its table.
#
#   [ALL_REDUCE_TEST=tests/all_reduce_test.py] [BACKENDS=nccl,mpi,accl] [DRY_RUN=1] utils/run_all_reduce.sh
#
# Ranks per node: TORCHHPC_GPUS_PER_NODE (site profile); nodes: the distinct hosts in $PBS_NODEFILE.
# The launcher is the site's mpiexec: MPICH/PALS style `-ppn`, or Open MPI's `--map-by ppr:N:node`.
set -euo pipefail
# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
load_config

test_py=${ALL_REDUCE_TEST:-tests/all_reduce_test.py}
backends=${BACKENDS:-nccl,mpi,accl}
ppn=$TORCHHPC_GPUS_PER_NODE
if [[ -n "${PBS_NODEFILE:-}" && -r "${PBS_NODEFILE:-}" ]]; then
  nodes=$(sort -u "$PBS_NODEFILE" | wc -l)
else
  [[ "$DRY_RUN" == 1 ]] || die "PBS_NODEFILE is not set: run this inside a PBS job (make test-pbs)"
  nodes=${NODES:-2}
fi
[[ -f "$TORCHHPC_ROOT/$test_py" || "$DRY_RUN" == 1 ]] || die "$test_py not found in $TORCHHPC_ROOT"
if mpiexec --version 2>/dev/null | grep -qi 'open mpi'; then
  per_node=(--map-by "ppr:$ppn:node")
else
  per_node=(-ppn "$ppn")
fi
step "$test_py on $nodes nodes x $ppn ranks, backends $backends"
status=0
for backend in ${backends//,/ }; do
  run mpiexec -n "$((nodes * ppn))" "${per_node[@]}" python "$TORCHHPC_ROOT/$test_py" --backend "$backend" \
    || status=$?
done
exit "$status"
