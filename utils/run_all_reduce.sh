#!/usr/bin/env bash
# Inside a PBS or Slurm job (submitted by `make test-pbs` / `make test-slurm`): run tests/all_reduce_test.py
# on every node of the job, one rank per GPU, once per backend, and print its table.
#
#   [ALL_REDUCE_TEST=tests/all_reduce_test.py] [BACKENDS=nccl,mpi,accl] [ALL_REDUCE_ARGS='-e 1M'] [DRY_RUN=1] \
#     utils/run_all_reduce.sh
#
# Nodes, ranks per node and the launcher: utils/lib/launch.sh.
set -euo pipefail
# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=utils/lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
load_config

test_py=${ALL_REDUCE_TEST:-tests/all_reduce_test.py}
backends=${BACKENDS:-nccl,mpi,accl}
[[ -f "$TORCHHPC_ROOT/$test_py" || "$DRY_RUN" == 1 ]] || die "$test_py not found in $TORCHHPC_ROOT"
launch_resolve
read -r -a extra_args <<<"${ALL_REDUCE_ARGS:-}"
step "$test_py on $LAUNCH_NODES node(s) x $LAUNCH_PPN ranks with $TORCHHPC_LAUNCHER, backends $backends"
status=0
for backend in ${backends//,/ }; do
  run "${LAUNCH[@]}" python "$TORCHHPC_ROOT/$test_py" --backend "$backend" "${extra_args[@]}" || status=$?
done
exit "$status"
