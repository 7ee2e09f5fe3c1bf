# shellcheck shell=bash disable=SC2034  # LAUNCH* are read by the scripts that source this file
# Inside a PBS or Slurm job: the allocation's shape and the site's launcher line for it, written once for
# utils/run_ranks.sh (the user's command on every rank) and utils/run_all_reduce.sh (our all-reduce table).
# Sourced after utils/lib/common.sh and load_config (config_env.sh).
#
# launch_resolve sets LAUNCH_NODES, LAUNCH_PPN and LAUNCH (the launcher's argv, to which the command is appended):
#   Nodes: the distinct hosts in $PBS_NODEFILE, or $SLURM_JOB_NUM_NODES.  Ranks per node: the first host's
#   lines in $PBS_NODEFILE (select's mpiprocs), or the Slurm allocation's tasks per node, else
#   TORCHHPC_GPUS_PER_NODE (site profile).
#   The launcher: TORCHHPC_LAUNCHER=mpiexec (the site's mpiexec: MPICH/PALS style `-ppn`, or Open MPI's
#   `--map-by ppr:N:node`; both read the PBS or Slurm allocation), or srun (Slurm only) with
#   `--mpi=$TORCHHPC_SRUN_MPI` (pmix, pmi2, cray_shasta: what the MPI library was built for).
#   Binding (LAUNCH_BIND says which): every rank to its share of the node's cores in the launcher's own words
#   (Open MPI `--map-by ppr:N:node:PE=C --bind-to core`, MPICH's Hydra `-bind-to core:C`, Cray PALS
#   `--cpu-bind depth -d C`, srun `--cpus-per-task C --cpu-bind=cores`); none when ranks outnumber cores.
#   A dry run outside a job assumes NODES (default 2) nodes.

launch_resolve() {
  LAUNCH_PPN=$TORCHHPC_GPUS_PER_NODE
  if [[ -n "${PBS_NODEFILE:-}" && -r "${PBS_NODEFILE:-}" ]]; then
    # one line per MPI process (select's mpiprocs), hosts in order
    LAUNCH_NODES=$(sort -u "$PBS_NODEFILE" | wc -l)
    LAUNCH_PPN=$(grep -cxF "$(head -n 1 "$PBS_NODEFILE")" "$PBS_NODEFILE")
  elif [[ -n "${SLURM_JOB_ID:-}" ]]; then
    LAUNCH_NODES=${SLURM_JOB_NUM_NODES:?SLURM_JOB_NUM_NODES not set inside Slurm job $SLURM_JOB_ID}
    # "2(x2)" or "4,2": the first node's task count (the same count on every node is assumed)
    local tasks=${SLURM_TASKS_PER_NODE:-$LAUNCH_PPN}
    LAUNCH_PPN=${tasks%%[(,]*}
  else
    [[ "$DRY_RUN" == 1 ]] || die "neither PBS_NODEFILE nor SLURM_JOB_ID is set: run this inside a PBS or Slurm job"
    LAUNCH_NODES=${NODES:-2}
  fi
  local n=$((LAUNCH_NODES * LAUNCH_PPN)) cores per
  # Each rank bound to its own cores, the node's shared evenly (the thread budget follows the binding): the
  # node's cores as the scheduler gave them, else the host's.  No binding where ranks outnumber cores.
  cores=${SLURM_CPUS_ON_NODE:-${NCPUS:-$(nproc)}}
  per=$((cores / LAUNCH_PPN))
  LAUNCH_BIND="$per core(s) per rank"
  ((per >= 1)) || LAUNCH_BIND="none ($LAUNCH_PPN ranks per node on $cores cores)"
  case "$TORCHHPC_LAUNCHER" in
    srun)
      [[ -n "${SLURM_JOB_ID:-}" || "$DRY_RUN" == 1 ]] || die "LAUNCHER=srun needs a Slurm allocation"
      LAUNCH=(srun "--mpi=$TORCHHPC_SRUN_MPI" --nodes "$LAUNCH_NODES" --ntasks-per-node "$LAUNCH_PPN" -n "$n")
      ((per < 1)) || LAUNCH+=(--cpus-per-task "$per" --cpu-bind=cores) ;;
    mpiexec)
      # Under PBS both wheels' mpiexecs read the job's hosts from $PBS_NODEFILE themselves (Open MPI: PRRTE's
      # ras/pbs; MPICH: Hydra's PBS support) and start remote ranks over ssh, as Cray's PALS mpiexec does.
      local version
      version=$(mpiexec --version 2>&1 || true)
      if grep -qi 'open mpi' <<<"$version"; then
        LAUNCH=(mpiexec -n "$n" --map-by "ppr:$LAUNCH_PPN:node$( ((per < 1)) || echo ":PE=$per")")
        if ((per >= 1)); then LAUNCH+=(--bind-to core); else LAUNCH+=(--bind-to none); fi
      elif grep -qi 'hydra' <<<"$version"; then
        LAUNCH=(mpiexec -n "$n" -ppn "$LAUNCH_PPN")
        ((per < 1)) || LAUNCH+=(-bind-to "core:$per")
      else  # Cray PALS (Derecho, Polaris): its own binding options
        LAUNCH=(mpiexec -n "$n" -ppn "$LAUNCH_PPN")
        ((per < 1)) || LAUNCH+=(--cpu-bind depth -d "$per")
      fi ;;
    *) die "LAUNCHER '$TORCHHPC_LAUNCHER' is not mpiexec or srun" ;;
  esac
}
