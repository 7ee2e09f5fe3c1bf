#!/usr/bin/env bash
# Inside a PBS or Slurm job (submitted by `make test-pbs` / `make test-slurm`): run tests/all_reduce_test.py
# on every node of the job, one rank per GPU, once per backend, and print its table.
#
#   [ALL_REDUCE_TEST=tests/all_reduce_test.py] [BACKENDS=nccl,mpi,accl] [ALL_REDUCE_ARGS='-e 1M'] [DRY_RUN=1] \
#     utils/run_all_reduce.sh
#
# Nodes: the distinct hosts in $PBS_NODEFILE, or $SLURM_JOB_NUM_NODES.  Ranks per node: the first host's
# lines in $PBS_NODEFILE (select's mpiprocs), or the Slurm allocation's tasks per node, else
# TORCHHPC_GPUS_PER_NODE (site profile).
# The launcher: TORCHHPC_LAUNCHER=mpiexec (the site's mpiexec: MPICH/PALS style `-ppn`, or Open MPI's
# `--map-by ppr:N:node`; both read the PBS or Slurm allocation), or srun (Slurm only) with
# `--mpi=$TORCHHPC_SRUN_MPI` (pmix, pmi2, cray_shasta: what the MPI library was built for).
set -euo pipefail
# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
load_config

test_py=${ALL_REDUCE_TEST:-tests/all_reduce_test.py}
backends=${BACKENDS:-nccl,mpi,accl}
ppn=$TORCHHPC_GPUS_PER_NODE
launcher=$TORCHHPC_LAUNCHER
if [[ -n "${PBS_NODEFILE:-}" && -r "${PBS_NODEFILE:-}" ]]; then
  # one line per MPI process (select's mpiprocs), hosts in order
  nodes=$(sort -u "$PBS_NODEFILE" | wc -l)
  ppn=$(grep -cxF "$(head -n 1 "$PBS_NODEFILE")" "$PBS_NODEFILE")
elif [[ -n "${SLURM_JOB_ID:-}" ]]; then
  nodes=${SLURM_JOB_NUM_NODES:?SLURM_JOB_NUM_NODES not set inside Slurm job $SLURM_JOB_ID}
  # "2(x2)" or "4,2": the first node's task count (this test wants the same count on every node)
  tasks=${SLURM_TASKS_PER_NODE:-$ppn}
  ppn=${tasks%%[(,]*}
else
  [[ "$DRY_RUN" == 1 ]] || die "neither PBS_NODEFILE nor SLURM_JOB_ID is set: run this inside a job (make test-pbs or make test-slurm)"
  nodes=${NODES:-2}
fi
[[ -f "$TORCHHPC_ROOT/$test_py" || "$DRY_RUN" == 1 ]] || die "$test_py not found in $TORCHHPC_ROOT"
case "$launcher" in
  srun)
    [[ -n "${SLURM_JOB_ID:-}" || "$DRY_RUN" == 1 ]] || die "LAUNCHER=srun needs a Slurm allocation"
    launch=(srun "--mpi=$TORCHHPC_SRUN_MPI" --nodes "$nodes" --ntasks-per-node "$ppn" -n "$((nodes * ppn))") ;;
  mpiexec)
    # Under PBS both wheels' mpiexecs read the job's hosts from $PBS_NODEFILE themselves (Open MPI: PRRTE's
    # ras/pbs; MPICH: Hydra's PBS support) and start remote ranks over ssh, as Cray's PALS mpiexec does.
    if mpiexec --version 2>/dev/null | grep -qi 'open mpi'; then
      launch=(mpiexec -n "$((nodes * ppn))" --map-by "ppr:$ppn:node")
    else
      launch=(mpiexec -n "$((nodes * ppn))" -ppn "$ppn")
    fi ;;
  *) die "LAUNCHER '$launcher' is not mpiexec or srun" ;;
esac
read -r -a extra_args <<<"${ALL_REDUCE_ARGS:-}"
step "$test_py on $nodes node(s) x $ppn ranks with $launcher, backends $backends"
status=0
for backend in ${backends//,/ }; do
  run "${launch[@]}" python "$TORCHHPC_ROOT/$test_py" --backend "$backend" "${extra_args[@]}" || status=$?
done
exit "$status"
