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
#   LAUNCH_HOSTS (space-separated host names), when set, restricts the ranks to those hosts, in the launcher's
#   words (srun --nodelist, Open MPI --host h:N,..., Hydra -hosts, PALS --hosts): the supervisor's healthy nodes;
#   LAUNCH_OVERLAP=1 lets a restarted srun step share the cores a step on a lost node still holds.
#
# launch_hosts prints the allocation's hosts, in order; launch_probe HOST says (exit status) whether HOST runs a
# process through the launcher within TORCHHPC_PROBE_S seconds (default 20): a node that died, hangs or lost its
# link does not.  Both speak the launcher's words of launch_host_flags; launch_flavor names the launcher once.

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
  [[ -z "${LAUNCH_HOSTS:-}" ]] || LAUNCH_NODES=$(wc -w <<<"$LAUNCH_HOSTS")
  local n=$((LAUNCH_NODES * LAUNCH_PPN)) cores per words=()
  LAUNCH_WORDS=()
  # Each rank bound to its own cores, the node's shared evenly (the thread budget follows the binding): the
  # node's cores as the scheduler gave them, else the host's.  No binding where ranks outnumber cores.
  cores=${SLURM_CPUS_ON_NODE:-${NCPUS:-$(nproc)}}
  per=$((cores / LAUNCH_PPN))
  LAUNCH_BIND="$per core(s) per rank"
  ((per >= 1)) || LAUNCH_BIND="none ($LAUNCH_PPN ranks per node on $cores cores)"
  launch_flavor
  [[ "$LAUNCH_FLAVOR" != srun || -n "${SLURM_JOB_ID:-}" || "$DRY_RUN" == 1 ]] \
    || die "LAUNCHER=srun needs a Slurm allocation"
  ((per < 1)) || launch_topology "$cores"
  case "$LAUNCH_FLAVOR" in
    srun)
      LAUNCH=(srun "--mpi=$TORCHHPC_SRUN_MPI" --nodes "$LAUNCH_NODES" --ntasks-per-node "$LAUNCH_PPN" -n "$n")
      ((per < 1)) || LAUNCH+=(--cpus-per-task "$per")
      ((per < 1)) || ((${#LAUNCH_WORDS[@]})) || LAUNCH+=(--cpu-bind=cores)
      # a step that ran on a lost node keeps its cores in Slurm's books until the node returns: share them
      [[ -z "${LAUNCH_OVERLAP:-}" ]] || LAUNCH+=(--overlap) ;;
    # Under PBS both wheels' mpiexecs read the job's hosts from $PBS_NODEFILE themselves (Open MPI: PRRTE's
    # ras/pbs; MPICH: Hydra's PBS support) and start remote ranks over ssh, as Cray's PALS mpiexec does.
    # Open MPI forwards only the variables named by -x to other nodes: the placement's maps among them.
    openmpi)
      LAUNCH=(mpiexec -n "$n")
      if ((per >= 1)); then words=(--map-by "ppr:$LAUNCH_PPN:node:PE=$per" --bind-to core)
      else words=(--map-by "ppr:$LAUNCH_PPN:node" --bind-to none); fi ;;
    hydra)
      LAUNCH=(mpiexec -n "$n" -ppn "$LAUNCH_PPN")
      ((per < 1)) || words=(-bind-to "core:$per") ;;
    pals)  # Cray PALS (Derecho, Polaris): its own binding options
      LAUNCH=(mpiexec -n "$n" -ppn "$LAUNCH_PPN")
      ((per < 1)) || words=(--cpu-bind depth -d "$per") ;;
  esac
  if ((${#LAUNCH_WORDS[@]})); then LAUNCH+=("${LAUNCH_WORDS[@]}"); else LAUNCH+=("${words[@]}"); fi
  # A rank with one core or less has no core for a helper thread that calls MPI beside the training thread (the
  # rehearsal buffer's worker): two threads busy-polling Open MPI's progress on one core starved each other, and
  # 2 nodes x 2 ranks x 1 core of the rehearsal example over MPI RMA never finished (2 s with yielding).  Open MPI
  # yields when idle only where it sees more ranks than slots; here it is told (on srun's line, as the variable
  # Open MPI's ranks read; MPICH's ignore it).
  if ((per <= 1)); then
    case "$LAUNCH_FLAVOR" in
      openmpi) LAUNCH+=(--mca mpi_yield_when_idle 1) ;;
      srun) LAUNCH+=("--export=ALL,OMPI_MCA_mpi_yield_when_idle=1") ;;
    esac
  fi
  [[ "$LAUNCH_FLAVOR" != openmpi ]] || ((${#LAUNCH_WORDS[@]} == 0)) || LAUNCH+=(-x TORCHHPC_CPU_MAP -x TORCHHPC_GPU_MAP)
  if [[ -n "${LAUNCH_HOSTS:-}" ]]; then
    local flags
    # shellcheck disable=SC2086  # the host list, one word per host
    mapfile -t flags < <(launch_host_flags "$LAUNCH_PPN" $LAUNCH_HOSTS)
    LAUNCH+=("${flags[@]}")
  fi
}

# launch_topology CORES: where the job holds its node whole (CORES, the scheduler's count, is every CPU of the
# host), each local rank's cores, GPU and NIC from the node's topology (torchhpc.runtime.topology: hwloc's
# XML from HWLOC_XMLFILE or lstopo, else sysfs; nodes of one job alike), in the launcher's words
# (LAUNCH_WORDS), with the maps the ranks read exported (TORCHHPC_CPU_MAP, TORCHHPC_GPU_MAP: a rank the launcher
# left unbound binds itself, and takes its GPU where the launcher set none).  Else LAUNCH_WORDS stays empty and
# launch_resolve's count of cores per rank binds.  A dry run outside a job plans nothing.
launch_topology() {
  local cores=$1 plan
  [[ "$DRY_RUN" != 1 ]] && ((cores >= $(getconf _NPROCESSORS_ONLN))) || return 0
  plan=$(python -m torchhpc.runtime.topology --ranks "$LAUNCH_PPN" --launcher "$LAUNCH_FLAVOR") || {
    printf 'warning: no plan from the node'"'"'s topology (its error above): %s\n' "$LAUNCH_BIND" >&2
    return 0
  }
  local lines
  mapfile -t lines <<<"$plan"
  export "${lines[0]}" "${lines[1]}"
  LAUNCH_WORDS=("${lines[@]:3}")
  if [[ "$LAUNCH_FLAVOR" == srun && "${SLURM_GPUS_ON_NODE:-0}" == 0 ]]; then  # no GPUs allocated: no GPU words
    local word kept=()
    for word in "${LAUNCH_WORDS[@]}"; do [[ "$word" == --gpu-bind=* ]] || kept+=("$word"); done
    LAUNCH_WORDS=("${kept[@]}")
  fi
  local cpus=${lines[0]#*=}
  LAUNCH_BIND="from the node's topology (${lines[2]}): cores ${cpus//:/ | }"
  [[ -z "$TORCHHPC_GPU_MAP" ]] || LAUNCH_BIND+="; GPUs $TORCHHPC_GPU_MAP"
}

# LAUNCH_FLAVOR: srun, or the site's mpiexec as openmpi, hydra (MPICH) or pals (Cray), asked once.
launch_flavor() {
  [[ -z "${LAUNCH_FLAVOR:-}" ]] || return 0
  case "$TORCHHPC_LAUNCHER" in
    srun) LAUNCH_FLAVOR=srun ;;
    mpiexec)
      local version
      version=$(mpiexec --version 2>&1 || true)
      if grep -qi 'open mpi' <<<"$version"; then LAUNCH_FLAVOR=openmpi
      elif grep -qi 'hydra' <<<"$version"; then LAUNCH_FLAVOR=hydra
      else LAUNCH_FLAVOR=pals; fi ;;
    *) die "LAUNCHER '$TORCHHPC_LAUNCHER' is not mpiexec or srun" ;;
  esac
}

# launch_host_flags PPN HOST...: the launcher's words (one per line) for "these hosts, PPN ranks each".
launch_host_flags() {
  local ppn=$1 list
  shift
  list=$(IFS=,; echo "$*")
  case "$LAUNCH_FLAVOR" in
    srun) printf '%s\n' "--nodelist=$list" ;;
    openmpi) printf '%s\n' --host "$(sed "s/,/:$ppn,/g; s/\$/:$ppn/" <<<"$list")" ;;
    hydra) printf '%s\n' -hosts "$list" ;;
    pals) printf '%s\n' --hosts "$list" ;;
  esac
}

launch_hosts() {
  if [[ -n "${PBS_NODEFILE:-}" && -r "${PBS_NODEFILE:-}" ]]; then
    awk '!seen[$0]++' "$PBS_NODEFILE"
  elif [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
    scontrol show hostnames "$SLURM_JOB_NODELIST"
  else
    die "neither PBS_NODEFILE nor SLURM_JOB_NODELIST is set: run this inside a PBS or Slurm job"
  fi
}

launch_probe() {
  local wait=${TORCHHPC_PROBE_S:-20} start=(mpiexec -n 1) flags
  launch_flavor
  [[ "$LAUNCH_FLAVOR" != srun ]] || start=(srun --overlap --nodes 1 --ntasks 1)
  mapfile -t flags < <(launch_host_flags 1 "$1")
  timeout -k 5 "$wait" "${start[@]}" "${flags[@]}" true >/dev/null 2>&1
}
