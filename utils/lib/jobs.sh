# shellcheck shell=bash disable=SC2153  # JOB_* inputs are set by the script that sources this file
# The scheduler-independent batch-job layer used by utils/submit_job.sh: resources, validation, ONE job
# script generator (PBS directives or Slurm directives over the same body), the submit line, the wait, the
# exit status and the log.  Sourced after utils/lib/common.sh and load_config (config_env.sh).
#
# Inputs (set by the caller): JOB_NAME JOB_SHAPE JOB_SCHEDULER JOB_WALLTIME JOB_ACCOUNT JOB_QUEUE JOB_NODES
# JOB_PPN JOB_CPUS JOB_GPUS JOB_SELECT JOB_SUBMIT JOB_COMMAND JOB_WORKDIR JOB_DETACH; empty means "the site's
# default".  JOB_EXPORTS: the job's export lines (job_exports, before config_env.sh is loaded).
# Shapes: build (one node, many cores), test (our all-reduce table on 2 nodes) and run (the user's own
# command: --nodes x --ranks-per-node, defaults from the site's test resources).
# JOB_WAIT_TIMEOUT (seconds, 0 = none): give up waiting (and cancel the job) after that long.
# JOB_PROGRESS_EVERY (seconds, default 60): how often the wait prints a new progress line when not on a terminal.

# PBS Pro select chunks: N:key=value[:key=value...][+N:...]; these keys must be whole numbers.
PBS_INT_KEYS=" ncpus mpiprocs ngpus ompthreads "
# Slurm job states after which the job will not run again.
SLURM_DONE_STATES=" COMPLETED FAILED CANCELLED TIMEOUT NODE_FAIL PREEMPTED OUT_OF_MEMORY BOOT_FAIL DEADLINE "

job_die_value() { die "$1 '$2' $3"; }

# JOB_DIR: this user's job scripts, logs and records, $TORCHHPC_JOBS_DIR or $TORCHHPC_PREFIX/jobs/<user>,
# made 0700 and refused when another user owns it or could write it (a shared checkout's build/ is everyone's).
job_private_dir() {
  local who
  who=$(id -un 2>/dev/null) || who=$(id -u)
  JOB_DIR=${TORCHHPC_JOBS_DIR:-$TORCHHPC_PREFIX/jobs/$who}
  # it goes into #PBS/#SBATCH directive lines, which no quoting protects
  [[ "$JOB_DIR" =~ ^[^[:space:]]+$ ]] || job_die_value "job directory" "$JOB_DIR" "has white space; set TORCHHPC_JOBS_DIR"
  # two submissions at once (torchhpc.submit from two sessions) may both create it: the second finds it made
  [[ -d "$JOB_DIR" ]] || { mkdir -p "${JOB_DIR%/*}" && mkdir -m 700 "$JOB_DIR" 2>/dev/null; } || [[ -d "$JOB_DIR" ]] \
    || die "cannot create $JOB_DIR; set TORCHHPC_JOBS_DIR"
  job_trusted "$JOB_DIR" 077
}

# job_trusted PATH MASK: PATH is no symlink, is this user's, and has none of MASK's permission bits.
job_trusted() {
  local owner mode
  [[ ! -L "$1" ]] || die "$1 is a symbolic link; refusing it (another user could point it anywhere)"
  read -r owner mode < <(stat -c '%u %a' "$1")
  [[ "$owner" == "$(id -u)" ]] || die "$1 is owned by uid $owner, not by you: refusing to keep jobs there (set TORCHHPC_JOBS_DIR)"
  (((8#$mode & 8#$2) == 0)) || die "$1 has mode $mode: others could change it; chmod go-rwx $1"
}

# Fill every JOB_* resource from the site defaults and check its syntax for the chosen scheduler.
job_resolve() {
  [[ "$JOB_NAME" =~ ^[A-Za-z][A-Za-z0-9._-]{0,235}$ ]] \
    || job_die_value --name "$JOB_NAME" "is not a valid job name (a letter, then letters, digits, . _ -)"
  case "$JOB_SHAPE" in build | test | run) ;; *) job_die_value --shape "$JOB_SHAPE" "is not build, test or run" ;; esac
  JOB_WORKDIR=${JOB_WORKDIR:-$TORCHHPC_ROOT}
  [[ -d "$JOB_WORKDIR" ]] || job_die_value --workdir "$JOB_WORKDIR" "is not a directory"
  JOB_SCHEDULER=${JOB_SCHEDULER:-$TORCHHPC_SCHEDULER}
  case "$JOB_SCHEDULER" in
    pbs | slurm) ;;
    none | "") die "no batch scheduler: neither sbatch nor qsub is on PATH here; submit from a login node, or pass --scheduler slurm|pbs (make: SCHEDULER=slurm|pbs)" ;;
    *) job_die_value SCHEDULER "$JOB_SCHEDULER" "is not pbs or slurm" ;;
  esac
  job_private_dir
  [[ "$JOB_SHAPE" == run && -z "$JOB_GPUS" && "${TORCHHPC_DETECT_GPUS:-0}" == 1 ]] && job_detect_gpus
  # spare nodes: the step's N plus K the allocation holds for it (utils/run_ranks.sh supervises)
  [[ "${JOB_SPARE:=0}" =~ ^[0-9]+$ ]] || job_die_value --spare-nodes "$JOB_SPARE" "is not a whole number"
  if ((JOB_SPARE > 0)); then
    [[ "$JOB_SHAPE" == run ]] || job_die_value --spare-nodes "$JOB_SPARE" "applies to a run (torchhpc jobscript) only"
    [[ "${JOB_NODES:-1}" =~ ^[1-9][0-9]*$ ]] || job_die_value --nodes "$JOB_NODES" "is not a positive whole number"
    JOB_NODES=$((${JOB_NODES:-1} + JOB_SPARE))
  fi
  if [[ "$JOB_SCHEDULER" == pbs ]]; then
    job_resolve_pbs
  else
    job_resolve_slurm
  fi
  [[ -z "$JOB_ACCOUNT" || "$JOB_ACCOUNT" =~ ^[A-Za-z0-9_.-]+$ ]] \
    || job_die_value --account "$JOB_ACCOUNT" "has characters no scheduler accepts"
  if [[ -z "$JOB_ACCOUNT" && "$DRY_RUN" != 1 ]]; then
    printf '%s: warning: no account given: the scheduler charges your default one, if it has one (--account, or %s_ACCOUNT)\n' \
      "${TORCHHPC_PROG:-${0##*/}}" "${JOB_SCHEDULER^^}" >&2
  fi
}

# A user's job on a profile for any cluster, --gpus not given: none when the scheduler says its nodes have no GPUs
# (Slurm: no gpu GRES in sinfo; PBS: no node with resources_available.ngpus above 0), else the profile's count.
job_detect_gpus() {
  local seen prog=${TORCHHPC_PROG:-${0##*/}}
  if [[ "$JOB_SCHEDULER" == slurm ]]; then
    seen=$(sinfo -h -o '%G' 2>/dev/null) || seen="?"
    [[ "$seen" == "?" || "$seen" == *gpu* ]] || JOB_GPUS=0
  else
    seen=$(pbsnodes -av 2>/dev/null) || seen="?"
    [[ "$seen" == "?" ]] || grep -Eq 'resources_available\.ngpus = [1-9]' <<<"$seen" || JOB_GPUS=0
  fi
  if [[ "$JOB_GPUS" == 0 ]]; then
    printf '%s: the scheduler reports no GPUs on its nodes: asking for none (--gpus N asks anyway)\n' "$prog" >&2
  elif [[ "$seen" == "?" ]]; then
    printf '%s: could not ask the scheduler about GPUs: assuming the profile'"'"'s %s per node (--gpus 0 for a CPU job)\n' \
      "$prog" "$TORCHHPC_GPUS_PER_NODE" >&2
  fi
}

job_resolve_pbs() {
  local shape=${JOB_SHAPE^^} chunk key value
  [[ "$shape" == RUN ]] && shape=TEST
  local select_var="TORCHHPC_PBS_SELECT_$shape" walltime_var="TORCHHPC_PBS_WALLTIME_$shape"
  [[ "$JOB_SHAPE" == run && -z "$JOB_SELECT" ]] && job_run_select "${!select_var}"
  JOB_SELECT=${JOB_SELECT:-${!select_var}}
  JOB_WALLTIME=${JOB_WALLTIME:-${!walltime_var}}
  JOB_QUEUE=${JOB_QUEUE:-$TORCHHPC_PBS_QUEUE}
  JOB_ACCOUNT=${JOB_ACCOUNT:-$TORCHHPC_PBS_ACCOUNT}
  JOB_SUBMIT=${JOB_SUBMIT:-$TORCHHPC_SUBMIT}
  read -r -a JOB_EXTRA <<<"${TORCHHPC_PBS_EXTRA:-}"
  [[ "$JOB_SELECT" =~ ^[0-9]+(:[a-z_]+=[^:+[:space:]]+)*(\+[0-9]+(:[a-z_]+=[^:+[:space:]]+)*)*$ ]] \
    || job_die_value --select "$JOB_SELECT" "is not a PBS select statement (N:key=value:...[+N:...])"
  IFS='+' read -r -a chunks <<<"$JOB_SELECT"
  for chunk in "${chunks[@]}"; do
    [[ "${chunk%%:*}" -ge 1 ]] || job_die_value --select "$JOB_SELECT" "asks for 0 chunks"
    IFS=':' read -r -a pairs <<<"${chunk#*:}"
    [[ "$chunk" == *:* ]] || pairs=()
    for key in "${pairs[@]}"; do
      value=${key#*=} key=${key%%=*}
      if [[ "$PBS_INT_KEYS" == *" $key "* && ! "$value" =~ ^[0-9]+$ ]]; then
        job_die_value --select "$JOB_SELECT" "has $key=$value (a whole number is needed)"
      fi
    done
  done
  [[ "$JOB_WALLTIME" =~ ^[0-9]+:[0-5][0-9]:[0-5][0-9]$ ]] || job_die_value --walltime "$JOB_WALLTIME" "is not HH:MM:SS"
  [[ "$JOB_QUEUE" =~ ^[A-Za-z0-9_.-]+(@[A-Za-z0-9_.-]+)?$ ]] || job_die_value --queue "$JOB_QUEUE" "is not a PBS queue name"
  case "$JOB_SUBMIT" in qcmd | qsub) ;; *) job_die_value --submit "$JOB_SUBMIT" "is not qcmd or qsub" ;; esac
  if [[ -z "$JOB_ACCOUNT" && "$TORCHHPC_PBS_ACCOUNT_REQUIRED" == 1 && "$DRY_RUN" != 1 ]]; then
    die "site $TORCHHPC_SITE needs a project account: PBS_ACCOUNT=<project code> make ... (torchhpc jobscript: --account <code>)"
  fi
  JOB_SCRIPT="$JOB_DIR/$JOB_NAME.pbs"
  JOB_LOG="$JOB_DIR/$JOB_NAME-%j.log"   # %j: the job id (PBS_JOBID in the job); resolved after submission
}

# A run-shaped job's PBS select from --nodes/--ranks-per-node/--cpus (cores per rank)/--gpus:
# N:ncpus=C*P:mpiprocs=P[:ngpus=G], each unset one from the first chunk of the site's test select (a whole node
# of the site's GPU queue: its cores shared by the ranks).
job_run_select() {
  local site=$1 cpus gpus ppn
  cpus=$(grep -oE '(^|:)ncpus=[0-9]+' <<<"${site%%+*}" | cut -d= -f2) || true
  gpus=$(grep -oE '(^|:)ngpus=[0-9]+' <<<"${site%%+*}" | cut -d= -f2) || true
  ppn=$(grep -oE '(^|:)mpiprocs=[0-9]+' <<<"${site%%+*}" | cut -d= -f2) || true
  JOB_NODES=${JOB_NODES:-1} JOB_PPN=${JOB_PPN:-${ppn:-1}}
  [[ "$JOB_PPN" =~ ^[1-9][0-9]*$ ]] || job_die_value --ranks-per-node "$JOB_PPN" "is not a positive whole number"
  cpus=${cpus:-$JOB_PPN}
  JOB_CPUS=${JOB_CPUS:-$((cpus / JOB_PPN > 0 ? cpus / JOB_PPN : 1))}
  JOB_GPUS=${JOB_GPUS:-${gpus:-0}}
  [[ "$JOB_NODES" =~ ^[1-9][0-9]*$ ]] || job_die_value --nodes "$JOB_NODES" "is not a positive whole number"
  [[ "$JOB_PPN" =~ ^[1-9][0-9]*$ ]] || job_die_value --ranks-per-node "$JOB_PPN" "is not a positive whole number"
  [[ "$JOB_CPUS" =~ ^[1-9][0-9]*$ ]] || job_die_value --cpus "$JOB_CPUS" "is not a positive whole number"
  [[ "$JOB_GPUS" =~ ^[0-9]+$ ]] || job_die_value --gpus "$JOB_GPUS" "is not a whole number"
  JOB_SELECT="$JOB_NODES:ncpus=$((JOB_CPUS * JOB_PPN)):mpiprocs=$JOB_PPN"
  ((JOB_GPUS > 0)) && JOB_SELECT+=":ngpus=$JOB_GPUS"
  # the chunk's other resources (Polaris' system=polaris) as the site asks them
  local pair chunk=${site%%+*}
  IFS=':' read -r -a pairs <<<"${chunk#*:}"
  for pair in "${pairs[@]}"; do
    [[ "$chunk" == *:* && "$pair" == *=* && ! "$pair" =~ ^(ncpus|mpiprocs|ngpus)= ]] && JOB_SELECT+=":$pair"
  done
  return 0
}

job_resolve_slurm() {
  local shape=${JOB_SHAPE^^} v
  [[ "$shape" == RUN ]] && shape=TEST
  if [[ "$JOB_SHAPE" == run ]]; then
    # the user's job: 1 node unless asked; the node's cores (the site's per test task) shared by its ranks
    JOB_NODES=${JOB_NODES:-1} JOB_PPN=${JOB_PPN:-$TORCHHPC_GPUS_PER_NODE}
    [[ "$JOB_PPN" =~ ^[1-9][0-9]*$ ]] || job_die_value --ranks-per-node "$JOB_PPN" "is not a positive whole number"
    local per_node=$((TORCHHPC_SLURM_CPUS_TEST * TORCHHPC_GPUS_PER_NODE))
    JOB_CPUS=${JOB_CPUS:-$((per_node / JOB_PPN > 0 ? per_node / JOB_PPN : 1))}
  fi
  v="TORCHHPC_SLURM_NODES_$shape"; JOB_NODES=${JOB_NODES:-${!v}}
  v="TORCHHPC_SLURM_CPUS_$shape"; JOB_CPUS=${JOB_CPUS:-${!v}}
  v="TORCHHPC_SLURM_GPUS_$shape"; JOB_GPUS=${JOB_GPUS:-${!v}}
  v="TORCHHPC_SLURM_TIME_$shape"; JOB_WALLTIME=${JOB_WALLTIME:-${!v}}
  # A build is one task using many cores; a test runs one rank per GPU.
  if [[ "$JOB_SHAPE" == build ]]; then JOB_PPN=${JOB_PPN:-1}; else JOB_PPN=${JOB_PPN:-$TORCHHPC_GPUS_PER_NODE}; fi
  JOB_QUEUE=${JOB_QUEUE:-$TORCHHPC_SLURM_PARTITION}
  JOB_ACCOUNT=${JOB_ACCOUNT:-$TORCHHPC_SLURM_ACCOUNT}
  read -r -a JOB_EXTRA <<<"${TORCHHPC_SLURM_EXTRA:-}"
  [[ "$JOB_NODES" =~ ^[1-9][0-9]*$ ]] || job_die_value --nodes "$JOB_NODES" "is not a positive whole number"
  [[ "$JOB_PPN" =~ ^[1-9][0-9]*$ ]] || job_die_value --ranks-per-node "$JOB_PPN" "is not a positive whole number"
  [[ "$JOB_CPUS" =~ ^[1-9][0-9]*$ ]] || job_die_value --cpus "$JOB_CPUS" "is not a positive whole number"
  [[ "$JOB_GPUS" =~ ^[0-9]+$ ]] || job_die_value --gpus "$JOB_GPUS" "is not a whole number"
  [[ "$JOB_WALLTIME" =~ ^([0-9]+-)?[0-9]+:[0-5][0-9]:[0-5][0-9]$ ]] \
    || job_die_value --walltime "$JOB_WALLTIME" "is not HH:MM:SS (or D-HH:MM:SS)"
  [[ -z "$JOB_QUEUE" || "$JOB_QUEUE" =~ ^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*$ ]] \
    || job_die_value --partition "$JOB_QUEUE" "is not a Slurm partition name"
  if [[ -z "$JOB_ACCOUNT" && "$TORCHHPC_SLURM_ACCOUNT_REQUIRED" == 1 && "$DRY_RUN" != 1 ]]; then
    die "site $TORCHHPC_SITE needs an account: SLURM_ACCOUNT=<account> make ... (torchhpc jobscript: --account <account>)"
  fi
  JOB_SCRIPT="$JOB_DIR/$JOB_NAME.slurm"
  JOB_LOG="$JOB_DIR/$JOB_NAME-%j.log"   # %j: the job id; resolved after submission
}

# The scheduler's directive lines for the resolved resources.
job_directives() {
  if [[ "$JOB_SCHEDULER" == pbs ]]; then
    printf '#PBS %s\n' "-N $JOB_NAME"
    [[ -n "$JOB_ACCOUNT" ]] && printf '#PBS %s\n' "-A $JOB_ACCOUNT"
    # the job writes its own log as it goes (see job_write_script); PBS's copy of stdout, kept apart, holds
    # what the job printed before that and what PBS itself says
    printf '#PBS %s\n' "-q $JOB_QUEUE" "-l select=$JOB_SELECT" "-l walltime=$JOB_WALLTIME" "-j oe" "-o $JOB_DIR/$JOB_NAME.pbs-out"
    # a test or run takes whole hosts, one chunk each (PBS packs chunks by default); a site's place= wins
    if [[ "$JOB_SHAPE" != build && ("$JOB_SELECT" == *+* || "${JOB_SELECT%%:*}" -gt 1) \
      && " ${JOB_EXTRA[*]} " != *place=* ]]; then
      printf '#PBS %s\n' "-l place=scatter:excl"
    fi
    ((JOB_SPARE > 0)) && printf '#PBS %s\n' "-W tolerate_node_failures=all"
    ((${#JOB_EXTRA[@]})) && printf '#PBS %s\n' "${JOB_EXTRA[*]}"
  else
    printf '#SBATCH %s\n' "--job-name=$JOB_NAME"
    [[ -n "$JOB_ACCOUNT" ]] && printf '#SBATCH %s\n' "--account=$JOB_ACCOUNT"
    [[ -n "$JOB_QUEUE" ]] && printf '#SBATCH %s\n' "--partition=$JOB_QUEUE"
    printf '#SBATCH %s\n' "--nodes=$JOB_NODES" "--ntasks-per-node=$JOB_PPN" "--cpus-per-task=$JOB_CPUS"
    ((JOB_GPUS > 0)) && printf '#SBATCH %s\n' "--gpus-per-node=$JOB_GPUS"
    printf '#SBATCH %s\n' "--time=$JOB_WALLTIME" "--output=$JOB_LOG"
    ((JOB_SPARE > 0)) && printf '#SBATCH %s\n' "--no-kill"
    ((${#JOB_EXTRA[@]})) && printf '#SBATCH %s\n' "${JOB_EXTRA[@]}"
  fi
  return 0
}

# JOB_SCRIPT_TEXT: the whole job script; the body is the same for every scheduler.
job_write_script() {
  JOB_SCRIPT_TEXT=$(
    # PBS starts jobs in a fresh login environment (hence -l: the module command); sbatch passes the
    # submitting shell's environment on, which a login shell would reset (Debian's /etc/profile sets PATH).
    if [[ "$JOB_SCHEDULER" == pbs ]]; then printf '#!/bin/bash -l\n'; else printf '#!/bin/bash\n'; fi
    job_directives
    cat <<JOB
# Written by utils/submit_job.sh ($JOB_SCHEDULER) for site $(printf '%q' "$TORCHHPC_SITE"); runs in the directory below.
set -euo pipefail
JOB
    # PBS copies a job's stdout back only when it ends: the job writes its log on the shared file system
    # itself, so that the wait (and `tail -f`) sees it grow.  NCAR's qcmd streams the output instead.
    if [[ "$JOB_SCHEDULER" == pbs ]] && ! job_via_qcmd; then
      # shellcheck disable=SC2016  # ${PBS_JOBID} is the job's, expanded when it runs
      printf 'exec >>%q"${PBS_JOBID}".log 2>&1\n' "${JOB_LOG%\%j.log}"
    fi
    cat <<JOB
cd $(printf '%q' "$JOB_WORKDIR")
export SITE=$(printf '%q' "$TORCHHPC_SITE") PYTORCH_VERSION=$(printf '%q' "$PYTORCH_VERSION") TORCHHPC_PREFIX=$(printf '%q' "$TORCHHPC_PREFIX") SCHEDULER=$JOB_SCHEDULER$( ((JOB_SPARE == 0)) || echo " TORCHHPC_SPARE_NODES=$JOB_SPARE")
echo "job \${PBS_JOBID:-\${SLURM_JOB_ID:-?}} on \$(hostname) at \$(date -u +%FT%TZ)"
$JOB_EXPORTS
printf 'command: %s\n' $(printf '%q' "$JOB_COMMAND")
$JOB_COMMAND
JOB
  )
}

# The knobs of config_env.sh and the build scripts (docs/cluster.md): those set at submission are written
# into the job script, since PBS starts a job in a fresh login environment (Slurm would pass them on).
JOB_KNOBS="ENV_KIND TORCHHPC_ENV_PREFIX_OVERRIDE TORCHHPC_VENV_ARGS TORCHHPC_NO_MODULES TORCHHPC_NO_ENV
  NCCL_OFI_PREFIX_OVERRIDE NCCL_VERSION_OVERRIDE TORCH_CUDA_ARCH_LIST_OVERRIDE MAX_JOBS GPUS_PER_NODE LAUNCHER
  SRUN_MPI STOP_AFTER TORCHHPC_PATCH_DIR PYTORCH_GIT TORCHVISION_GIT NCCL_GIT NCCL_HOME AWS_OFI_NCCL_GIT
  AWS_OFI_NCCL_SOURCES AWS_OFI_NCCL_TAG AWS_OFI_NCCL_VERSION CUDA_HOME CUDNN_ROOT LIBFABRIC_ROOT HWLOC_ROOT
  MPICC MPICXX CUDA_MODULE CUDA_MISMATCH_OK TORCHHPC_PROBE_S"

# The job's export lines: the knobs set here; and where the job is to run in an environment of the user's
# (TORCHHPC_JOB_PYENV, from `torchhpc jobscript --env current`; or TORCHHPC_NO_ENV=1 with a venv active) instead
# of the site's, that environment as it was at submission: its modules (TORCHHPC_JOB_MODULES), then the venv's
# activation, conda's, or its bin/ first on PATH.
job_exports() {
  local name pyenv=${TORCHHPC_JOB_PYENV:-} modules=${TORCHHPC_JOB_MODULES:-}
  for name in $JOB_KNOBS; do
    [[ -n "${!name+set}" ]] && printf 'export %s=%q\n' "$name" "${!name}"
  done
  if [[ -z "$pyenv" && "${TORCHHPC_NO_ENV:-0}" == 1 && -f "${VIRTUAL_ENV:-}/bin/activate" ]]; then
    pyenv=$VIRTUAL_ENV
  fi
  [[ -n "$pyenv" ]] || return 0
  printf 'export TORCHHPC_NO_ENV=1%s\n' "${modules:+ TORCHHPC_NO_MODULES=1}"
  if [[ -n "$modules" ]]; then
    # shellcheck disable=SC2086  # a list of module names
    printf 'module load %s\n' "$(printf '%q ' ${modules//:/ })"
  fi
  if [[ -f "$pyenv/bin/activate" && ! -d "$pyenv/conda-meta" ]]; then
    printf 'source %q\n' "$pyenv/bin/activate"
  elif [[ -d "$pyenv/conda-meta" && -n "${TORCHHPC_JOB_CONDA_SH:-}" ]]; then
    printf 'source %q && conda activate %q\n' "$TORCHHPC_JOB_CONDA_SH" "$pyenv"
  else
    # shellcheck disable=SC2016  # $PATH is the job's, expanded when it runs
    printf 'export PATH=%q:"$PATH"\n' "$pyenv/bin"
  fi
}

# NCAR's blocking qcmd submits this PBS job (the site's choice), unless it is to be detached from.
job_via_qcmd() { [[ "$JOB_SUBMIT" == qcmd && "$JOB_DETACH" != 1 ]]; }

job_build_submit() {
  if [[ "$JOB_SCHEDULER" == slurm ]]; then
    JOB_SUBMIT_CMD=(sbatch --parsable "$JOB_SCRIPT")
  elif job_via_qcmd; then
    JOB_SUBMIT_CMD=(qcmd -N "$JOB_NAME" -q "$JOB_QUEUE" -l "select=$JOB_SELECT" -l "walltime=$JOB_WALLTIME")
    [[ -n "$JOB_ACCOUNT" ]] && JOB_SUBMIT_CMD+=(-A "$JOB_ACCOUNT")
    # A login shell, as the #!/bin/bash -l line gives qsub jobs: the module command must be there.
    JOB_SUBMIT_CMD+=("${JOB_EXTRA[@]}" -- bash -l "$JOB_SCRIPT")
  else
    JOB_SUBMIT_CMD=(qsub "$JOB_SCRIPT")
  fi
}

# Print the last lines of the job's log (the whole story of a failed job is usually there), and what PBS
# itself wrote to the job's stdout (e.g. "job killed: walltime"), which it copies back as the job ends.
job_show_log() {
  local pbs_out=$JOB_DIR/$JOB_NAME.pbs-out
  if [[ -f "$JOB_LOG" ]]; then
    step "log $JOB_LOG (last 40 lines)"
    tail -n 40 "$JOB_LOG"
  else
    step "no log at $JOB_LOG"
  fi
  if [[ "$JOB_SCHEDULER" == pbs ]]; then
    JOB_WAIT_TIMEOUT=10 job_wait "PBS to copy $pbs_out back" test -e "$pbs_out" >/dev/null 2>&1 || true
    if [[ -s "$pbs_out" ]]; then
      step "PBS's own output $pbs_out"
      cat "$pbs_out"
    fi
  fi
}

# Submit, then either return at once (--detach: say how to re-attach) or follow the job to its end.
job_run() {
  command -v "${JOB_SUBMIT_CMD[0]}" >/dev/null \
    || die "'${JOB_SUBMIT_CMD[0]}' not found: submit from a ${JOB_SCHEDULER^^} login node"
  printf '%s\n' "$JOB_SCRIPT_TEXT" >"$JOB_SCRIPT"
  if [[ "${JOB_SUBMIT_CMD[0]}" == qcmd ]]; then
    # NCAR's qcmd: it blocks, streams the job's output and returns its exit status; it takes no job id.
    step "submitting $JOB_NAME ($JOB_SELECT, $JOB_WALLTIME, queue $JOB_QUEUE) with qcmd (it streams the job's output)"
    local status=0
    "${JOB_SUBMIT_CMD[@]}" || status=$?
    step "$JOB_NAME finished with exit status $status"
    exit "$status"
  fi
  job_submit
  printf 'JOB_SCHEDULER=%q JOB_ID=%q JOB_LOG=%q JOB_SHAPE=%q JOB_WALLTIME=%q\n' \
    "$JOB_SCHEDULER" "$JOB_ID" "$JOB_LOG" "$JOB_SHAPE" "$JOB_WALLTIME" >"$JOB_DIR/$JOB_NAME.job"
  [[ -z "${JOB_RECORD_TO:-}" ]] || (umask 077 && cat "$JOB_DIR/$JOB_NAME.job" >>"$JOB_RECORD_TO")
  if [[ "$JOB_DETACH" == 1 ]]; then
    step "detached from $(job_kind) job $JOB_ID; it runs on. Follow it with: make job-wait JOB=$JOB_NAME" \
      "(or: bash utils/submit_job.sh --attach $JOB_NAME); its log as it grows: $JOB_LOG"
    exit 0
  fi
  step "waiting for $(job_kind) job $JOB_ID; Ctrl-C deletes it (DETACH=1 / --detach leaves a job running)"
  job_follow
}

# Hand the job to the scheduler: JOB_ID, and JOB_LOG with Slurm's %j resolved.
job_submit() {
  local out
  out=$("${JOB_SUBMIT_CMD[@]}" 2>&1) || die "${JOB_SUBMIT_CMD[0]} refused the job: $out; script: $JOB_SCRIPT"
  JOB_ID=$(tail -n 1 <<<"$out")
  if [[ "$JOB_SCHEDULER" == slurm ]]; then
    JOB_ID=${JOB_ID%%;*}
    [[ "$JOB_ID" =~ ^[0-9]+$ ]] || die "sbatch printed '$out', not a job id"
    JOB_LOG=${JOB_LOG//%j/$JOB_ID}
    step "submitted $JOB_NAME as Slurm job $JOB_ID ($JOB_NODES node(s) x $JOB_PPN task(s), $JOB_CPUS cpu(s)/task, time $JOB_WALLTIME${JOB_QUEUE:+, partition $JOB_QUEUE}); log: $JOB_LOG"
  else
    [[ "$JOB_ID" =~ ^[0-9]+(\[\])?\.[A-Za-z0-9_.-]+$ ]] || die "qsub printed '$out', not a job id; script: $JOB_SCRIPT"
    JOB_LOG=${JOB_LOG//%j/$JOB_ID}
    step "submitted $JOB_NAME as PBS job $JOB_ID ($JOB_SELECT, $JOB_WALLTIME, queue $JOB_QUEUE); log: $JOB_LOG"
  fi
}

# --attach NAME: follow a job submitted earlier (its record $JOB_DIR/NAME.job) to its end.
job_attach() {
  job_private_dir
  local record="$JOB_DIR/$1.job"
  [[ "$1" =~ ^[A-Za-z][A-Za-z0-9._-]*$ ]] || job_die_value --attach "$1" "is not a job name"
  [[ -f "$record" ]] || die "no job named '$1' was submitted from here (no $record)"
  job_trusted "$record" 022
  # shellcheck disable=SC1090  # the record is written by job_run, %q-quoted, in this user's 0700 JOB_DIR
  source "$record"
  JOB_NAME=$1
  step "following $(job_kind) job $JOB_ID ($JOB_NAME); Ctrl-C deletes it"
  job_follow
}

# Wait for the job with its progress shown, then show its log and exit with its status.
job_follow() {
  JOB_SUBMITTED=$SECONDS JOB_STARTED="" JOB_SHOWN="" JOB_SHOWN_AT=-1
  trap 'job_cancel; step "interrupted: $(job_cancelled) $(job_kind) job $JOB_ID"; job_show_log; exit 130' INT TERM
  if ! job_wait "$(job_kind) job $JOB_ID" job_poll; then
    job_cancel
    job_show_log
    die "gave up on $(job_kind) job $JOB_ID after JOB_WAIT_TIMEOUT=${JOB_WAIT_TIMEOUT}s; it was $(job_cancelled)"
  fi
  trap - INT TERM
  [[ -t 2 ]] && printf '\n' >&2
  local status
  if [[ "$JOB_SCHEDULER" == pbs ]]; then job_status_pbs; else job_status_slurm; fi
  status=$JOB_STATUS
  job_show_log
  step "$JOB_NAME ($(job_kind) job $JOB_ID) finished: ${JOB_END:+$JOB_END, }exit status $status"
  exit "$status"
}

job_kind() { if [[ "$JOB_SCHEDULER" == pbs ]]; then echo PBS; else echo Slurm; fi; }
job_cancelled() { if [[ "$JOB_SCHEDULER" == pbs ]]; then echo "deleted (qdel)"; else echo "cancelled (scancel)"; fi; }

job_cancel() {
  if [[ "$JOB_SCHEDULER" == pbs ]]; then qdel "$JOB_ID" 2>/dev/null || true; else scancel "$JOB_ID" 2>/dev/null || true; fi
}

# job_wait WHAT TEST...: the one wait on the scheduler.  Poll TEST (0.2 s growing to 5 s) until it succeeds;
# past JOB_WAIT_TIMEOUT seconds (0 or unset: no limit) return 1 and say what was waited for.
job_wait() {
  local what=$1 step_ms=200 waited=0 deadline_ms=$((${JOB_WAIT_TIMEOUT:-0} * 1000))
  shift
  until "$@"; do
    if ((deadline_ms > 0 && waited >= deadline_ms)); then
      step "gave up waiting for $what after JOB_WAIT_TIMEOUT=${JOB_WAIT_TIMEOUT}s"
      return 1
    fi
    sleep "$((step_ms / 1000)).$(printf '%03d' $((step_ms % 1000)))"
    waited=$((waited + step_ms))
    step_ms=$((step_ms * 2 > 5000 ? 5000 : step_ms * 2))
  done
}

# One look at the job: JOB_RECORD (the scheduler's record of it: `qstat -x -f` or `scontrol show job -o`;
# empty once the scheduler forgot it), JOB_STATE (PBS's letter or Slurm's word; "gone" when forgotten), the
# progress line, and success once the job has ended (its last record then gives the exit status).
job_poll() {
  if [[ "$JOB_SCHEDULER" == pbs ]]; then
    if JOB_RECORD=$(qstat -x -f "$JOB_ID" 2>&1); then
      JOB_STATE=$(sed -n 's/^ *job_state = //p' <<<"$JOB_RECORD")
    elif [[ "$JOB_RECORD" == *"Unknown Job Id"* ]]; then
      JOB_RECORD="" JOB_STATE=gone   # a server without job history forgets a job as it ends
    else
      return 1                       # the server did not answer this time
    fi
  else
    JOB_RECORD=$(scontrol show job -o "$JOB_ID" 2>/dev/null) || JOB_RECORD=""
    JOB_STATE=$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"$JOB_RECORD")
    [[ -n "$JOB_STATE" ]] || JOB_STATE=gone   # purged after MinJobAge
  fi
  job_progress
  [[ "$JOB_STATE" == F || "$JOB_STATE" == gone || "$SLURM_DONE_STATES" == *" $JOB_STATE "* ]]
}

# The progress line: the job's state, how long it has queued or run, and the log's latest line, with ninja's
# [N/M] as a percentage when the log has one.  On a terminal it is redrawn in place at each poll; otherwise a
# new line is printed when the state changes or, at most every JOB_PROGRESS_EVERY seconds (default 60), when
# the log has moved on.
job_progress() {
  local now=$SECONDS since last="" tail ninja line
  case "$JOB_STATE" in R | RUNNING | E | COMPLETING) JOB_STARTED=${JOB_STARTED:-$now} ;; esac
  if [[ -n "$JOB_STARTED" ]]; then since="ran $(job_hms $((now - JOB_STARTED)))"; else since="queued $(job_hms $((now - JOB_SUBMITTED)))"; fi
  if [[ -f "$JOB_LOG" ]]; then
    tail=$(tail -n 200 "$JOB_LOG")
    last=$(grep -v '^[[:space:]]*$' <<<"$tail" | tail -n 1 | tr -d '\r' | cut -c 1-160) || true
    ninja=$(grep -oE '^\[[0-9]+/[0-9]+\]' <<<"$tail" | tail -n 1) || true
    if [[ "$ninja" =~ ^\[([0-9]+)/([1-9][0-9]*)\]$ ]]; then
      last="$((BASH_REMATCH[1] * 100 / BASH_REMATCH[2]))% $last"
    fi
  fi
  line="[$JOB_ID $JOB_STATE, $since] $last"
  if [[ -t 2 ]]; then
    printf '\r%s\033[K' "${line:0:$((${COLUMNS:-120} - 1))}" >&2
  elif [[ "$JOB_STATE $last" != "$JOB_SHOWN" ]] \
    && { [[ "$JOB_STATE" != "${JOB_SHOWN%% *}" ]] || ((now - JOB_SHOWN_AT >= ${JOB_PROGRESS_EVERY:-60})); }; then
    printf '%s\n' "$line" >&2
    JOB_SHOWN="$JOB_STATE $last" JOB_SHOWN_AT=$now
  fi
}

job_hms() { printf '%02d:%02d:%02d' $(($1 / 3600)) $(($1 / 60 % 60)) $(($1 % 60)); }

# PBS: the job's last record (qstat -x, job history on) as JOB_STATUS and a clear message.
job_status_pbs() {
  local info=$JOB_RECORD substate code
  substate=$(sed -n 's/^ *substate = //p' <<<"$info")
  code=$(sed -n 's/^ *Exit_status = //p' <<<"$info")
  if [[ -z "$code" ]]; then
    JOB_STATUS=1
    step "PBS keeps no record of job $JOB_ID (job history off?): its exit status is unknown; see its log"
  elif ((substate == 91)); then  # JOB_SUBSTATE_TERMINATED: deleted by qdel
    JOB_STATUS=130
    step "PBS job $JOB_ID was deleted (qdel, or by an administrator) before it finished"
  elif ((code == -29)); then  # JOB_EXEC_KILL_WALLTIME
    JOB_STATUS=124
    step "PBS job $JOB_ID hit its walltime ($JOB_WALLTIME) and was killed: raise it (PBS_WALLTIME_${JOB_SHAPE^^} / --walltime)"
  elif ((code < 0)); then
    JOB_STATUS=1
    step "PBS could not run job $JOB_ID (Exit_status $code: see 'JOB_EXEC' codes in the PBS admin guide; comment: $(sed -n 's/^ *comment = //p' <<<"$info"))"
  elif ((code >= 256)); then  # killed by a signal: PBS reports 256 + the signal
    JOB_STATUS=$((128 + code - 256))
    step "PBS job $JOB_ID was killed by signal $((code - 256))"
  else
    JOB_STATUS=$code
    ((code == 0)) || step "PBS job $JOB_ID failed: exit status $code"
  fi
}

# Slurm: the job's final state and ExitCode (its last scontrol record) as JOB_STATUS and a clear message.
job_status_slurm() {
  local info=$JOB_RECORD state exit_code code signal
  state=$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"$info")
  JOB_END=$state
  exit_code=$(sed -n 's/.* ExitCode=\([0-9]*:[0-9]*\).*/\1/p' <<<"$info")
  code=${exit_code%%:*} signal=${exit_code##*:}
  case "$state" in
    COMPLETED) JOB_STATUS=0 ;;
    TIMEOUT) JOB_STATUS=124
      step "Slurm job $JOB_ID hit its time limit ($(sed -n 's/.* TimeLimit=\([^ ]*\).*/\1/p' <<<"$info")) and was killed: raise the time (SLURM_TIME_${JOB_SHAPE^^} / --walltime)" ;;
    CANCELLED) JOB_STATUS=130
      step "Slurm job $JOB_ID was cancelled (scancel, or by an administrator) before it finished" ;;
    OUT_OF_MEMORY) JOB_STATUS=137; step "Slurm job $JOB_ID ran out of memory" ;;
    FAILED) JOB_STATUS=$((code > 0 ? code : (signal > 0 ? 128 + signal : 1)))
      step "Slurm job $JOB_ID failed: exit code $code$( ((signal > 0)) && echo ", signal $signal")" ;;
    "") JOB_STATUS=1
      step "slurmctld no longer knows job $JOB_ID (it keeps ended jobs MinJobAge seconds): its exit status is unknown; see its log" ;;
    *) JOB_STATUS=1; step "Slurm job $JOB_ID ended in state $state (reason: $(sed -n 's/.* Reason=\([^ ]*\).*/\1/p' <<<"$info"))" ;;
  esac
}

