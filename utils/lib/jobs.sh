# shellcheck shell=bash
# The scheduler-independent batch-job layer used by utils/submit_job.sh: resources, validation, ONE job
# script generator (PBS directives or Slurm directives over the same body), the submit line, the wait, the
# exit status and the log.  Sourced after utils/lib/common.sh and load_config (config_env.sh).
#
# Inputs (set by the caller): JOB_NAME JOB_SHAPE JOB_SCHEDULER JOB_WALLTIME JOB_ACCOUNT JOB_QUEUE JOB_NODES
# JOB_PPN JOB_CPUS JOB_GPUS JOB_SELECT JOB_SUBMIT JOB_COMMAND; empty means "the site's default".  JOB_EXPORTS:
# the job's export lines (job_exports, before config_env.sh is loaded).
# JOB_WAIT_TIMEOUT (seconds, 0 = none): give up waiting (and cancel the job) after that long.

# PBS Pro select chunks: N:key=value[:key=value...][+N:...]; these keys must be whole numbers.
PBS_INT_KEYS=" ncpus mpiprocs ngpus ompthreads "
# Slurm job states after which the job will not run again.
SLURM_DONE_STATES=" COMPLETED FAILED CANCELLED TIMEOUT NODE_FAIL PREEMPTED OUT_OF_MEMORY BOOT_FAIL DEADLINE "

job_die_value() { die "$1 '$2' $3"; }

# Fill every JOB_* resource from the site defaults and check its syntax for the chosen scheduler.
job_resolve() {
  [[ "$JOB_NAME" =~ ^[A-Za-z][A-Za-z0-9._-]{0,235}$ ]] \
    || job_die_value --name "$JOB_NAME" "is not a valid job name (a letter, then letters, digits, . _ -)"
  case "$JOB_SHAPE" in build | test) ;; *) job_die_value --shape "$JOB_SHAPE" "is not build or test" ;; esac
  JOB_SCHEDULER=${JOB_SCHEDULER:-$TORCHHPC_SCHEDULER}
  case "$JOB_SCHEDULER" in
    pbs | slurm) ;;
    none | "") die "no batch scheduler: neither sbatch nor qsub is on PATH here; submit from a login node, or set SCHEDULER=slurm|pbs" ;;
    *) job_die_value SCHEDULER "$JOB_SCHEDULER" "is not pbs or slurm" ;;
  esac
  JOB_DIR="$TORCHHPC_PREFIX/jobs"
  if [[ "$JOB_SCHEDULER" == pbs ]]; then
    job_resolve_pbs
  else
    job_resolve_slurm
  fi
  [[ -z "$JOB_ACCOUNT" || "$JOB_ACCOUNT" =~ ^[A-Za-z0-9_.-]+$ ]] \
    || job_die_value account "$JOB_ACCOUNT" "has characters no scheduler accepts"
}

job_resolve_pbs() {
  local shape=${JOB_SHAPE^^} chunk key value
  local select_var="TORCHHPC_PBS_SELECT_$shape" walltime_var="TORCHHPC_PBS_WALLTIME_$shape"
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
    die "site $TORCHHPC_SITE needs a project account: PBS_ACCOUNT=<project code> make ..."
  fi
  JOB_SCRIPT="$JOB_DIR/$JOB_NAME.pbs"
  JOB_LOG="$JOB_DIR/$JOB_NAME.log"
}

job_resolve_slurm() {
  local shape=${JOB_SHAPE^^} v
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
    die "site $TORCHHPC_SITE needs an account: SLURM_ACCOUNT=<account> make ..."
  fi
  JOB_SCRIPT="$JOB_DIR/$JOB_NAME.slurm"
  JOB_LOG="$JOB_DIR/$JOB_NAME-%j.log"   # %j: the job id; resolved after submission
}

# The scheduler's directive lines for the resolved resources.
job_directives() {
  if [[ "$JOB_SCHEDULER" == pbs ]]; then
    printf '#PBS %s\n' "-N $JOB_NAME"
    [[ -n "$JOB_ACCOUNT" ]] && printf '#PBS %s\n' "-A $JOB_ACCOUNT"
    printf '#PBS %s\n' "-q $JOB_QUEUE" "-l select=$JOB_SELECT" "-l walltime=$JOB_WALLTIME" "-j oe" "-o $JOB_LOG"
    # a test takes whole hosts, one chunk each (PBS packs chunks by default); a site's own place= wins
    if [[ "$JOB_SHAPE" == test && ("$JOB_SELECT" == *+* || "${JOB_SELECT%%:*}" -gt 1) \
      && " ${JOB_EXTRA[*]} " != *place=* ]]; then
      printf '#PBS %s\n' "-l place=scatter:excl"
    fi
    ((${#JOB_EXTRA[@]})) && printf '#PBS %s\n' "${JOB_EXTRA[*]}"
  else
    printf '#SBATCH %s\n' "--job-name=$JOB_NAME"
    [[ -n "$JOB_ACCOUNT" ]] && printf '#SBATCH %s\n' "--account=$JOB_ACCOUNT"
    [[ -n "$JOB_QUEUE" ]] && printf '#SBATCH %s\n' "--partition=$JOB_QUEUE"
    printf '#SBATCH %s\n' "--nodes=$JOB_NODES" "--ntasks-per-node=$JOB_PPN" "--cpus-per-task=$JOB_CPUS"
    ((JOB_GPUS > 0)) && printf '#SBATCH %s\n' "--gpus-per-node=$JOB_GPUS"
    printf '#SBATCH %s\n' "--time=$JOB_WALLTIME" "--output=$JOB_LOG"
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
# Written by utils/submit_job.sh ($JOB_SCHEDULER) for site $TORCHHPC_SITE; runs from the repository root.
set -euo pipefail
cd $(printf '%q' "$TORCHHPC_ROOT")
export SITE=$(printf '%q' "$TORCHHPC_SITE") PYTORCH_VERSION=$(printf '%q' "$PYTORCH_VERSION") TORCHHPC_PREFIX=$(printf '%q' "$TORCHHPC_PREFIX") SCHEDULER=$JOB_SCHEDULER
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
  MPICC MPICXX"

# The job's export lines: the knobs set here, and with TORCHHPC_NO_ENV=1 (no site environment is
# activated) the venv active at submission, so that the job runs in the same environment.
job_exports() {
  local name
  for name in $JOB_KNOBS; do
    [[ -n "${!name+set}" ]] && printf 'export %s=%q\n' "$name" "${!name}"
  done
  if [[ "${TORCHHPC_NO_ENV:-0}" == 1 && -n "${VIRTUAL_ENV:-}" && -f "${VIRTUAL_ENV:-}/bin/activate" ]]; then
    printf 'source %q\n' "$VIRTUAL_ENV/bin/activate"
  fi
  return 0
}

job_build_submit() {
  if [[ "$JOB_SCHEDULER" == slurm ]]; then
    JOB_SUBMIT_CMD=(sbatch --parsable "$JOB_SCRIPT")
  elif [[ "$JOB_SUBMIT" == qcmd ]]; then
    JOB_SUBMIT_CMD=(qcmd -N "$JOB_NAME" -q "$JOB_QUEUE" -l "select=$JOB_SELECT" -l "walltime=$JOB_WALLTIME")
    [[ -n "$JOB_ACCOUNT" ]] && JOB_SUBMIT_CMD+=(-A "$JOB_ACCOUNT")
    # A login shell, as the #!/bin/bash -l line gives qsub jobs: the module command must be there.
    JOB_SUBMIT_CMD+=("${JOB_EXTRA[@]}" -- bash -l "$JOB_SCRIPT")
  else
    JOB_SUBMIT_CMD=(qsub -W block=true "$JOB_SCRIPT")
  fi
}

# Print the last lines of the job's log (the whole story of a failed job is usually there).
job_show_log() {
  if [[ -f "$JOB_LOG" ]]; then
    step "log $JOB_LOG (last 40 lines)"
    tail -n 40 "$JOB_LOG"
  else
    step "no log at $JOB_LOG"
  fi
}

# Submit, wait, show the log, exit with the job's status.
job_run() {
  command -v "${JOB_SUBMIT_CMD[0]}" >/dev/null \
    || die "'${JOB_SUBMIT_CMD[0]}' not found: submit from a ${JOB_SCHEDULER^^} login node"
  mkdir -p "$JOB_DIR"
  printf '%s\n' "$JOB_SCRIPT_TEXT" >"$JOB_SCRIPT"
  if [[ "$JOB_SCHEDULER" == slurm ]]; then
    job_run_slurm
  elif [[ "$JOB_SUBMIT" == qsub ]]; then
    job_run_pbs
  fi
  # NCAR's qcmd: it blocks, streams the job's output and returns its exit status; it takes no job id.
  step "submitting $JOB_NAME ($JOB_SELECT, $JOB_WALLTIME, queue $JOB_QUEUE) with qcmd"
  local status=0
  "${JOB_SUBMIT_CMD[@]}" || status=$?
  step "$JOB_NAME finished with exit status $status"
  exit "$status"
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

# PBS: `qsub -W block=true` prints the job id at once and returns when the job ends, with its exit status.
# It runs in the background so that Ctrl-C and JOB_WAIT_TIMEOUT can delete the job (qdel), which a killed
# qsub would leave running.  The job's record (qstat -x, job history) then gives how it ended, once PBS has
# copied its output back.
job_run_pbs() {
  local out="$JOB_DIR/$JOB_NAME.qsub" qsub_pid id status=0 info state substate code
  step "submitting $JOB_NAME ($JOB_SELECT, $JOB_WALLTIME, queue $JOB_QUEUE) with qsub -W block=true; log: $JOB_LOG"
  rm -f "$JOB_LOG"
  "${JOB_SUBMIT_CMD[@]}" >"$out" 2>&1 &
  qsub_pid=$!
  JOB_WAIT_TIMEOUT=60 job_wait "qsub to print the job id" job_pbs_submitted "$out" "$qsub_pid" || true
  id=$(head -n 1 "$out")
  if [[ ! "$id" =~ ^[0-9]+(\[\])?\.[A-Za-z0-9_.-]+$ ]]; then
    wait "$qsub_pid" || true
    die "qsub refused the job: $(cat "$out"); script: $JOB_SCRIPT"
  fi
  step "submitted $JOB_NAME as PBS job $id"
  trap 'job_pbs_delete "$id" "$qsub_pid"; step "interrupted: deleted PBS job $id"; job_show_log; exit 130' INT TERM
  if ! job_wait "PBS job $id" job_pid_gone "$qsub_pid"; then
    job_pbs_delete "$id" "$qsub_pid"
    job_show_log
    die "gave up on PBS job $id after JOB_WAIT_TIMEOUT=${JOB_WAIT_TIMEOUT}s; it was deleted (qdel)"
  fi
  trap - INT TERM
  wait "$qsub_pid" || status=$?
  JOB_WAIT_TIMEOUT=120 job_wait "PBS job $id to finish (state F)" job_pbs_finished "$id" || true
  info=$(qstat -x -f "$id" 2>&1) || true
  state=$(sed -n 's/^ *job_state = //p' <<<"$info")
  substate=$(sed -n 's/^ *substate = //p' <<<"$info")
  code=$(sed -n 's/^ *Exit_status = //p' <<<"$info")
  if [[ -z "$code" ]]; then
    step "PBS job $id has no exit status (state ${state:-unknown}); qsub returned $status"
  elif ((substate == 91)); then  # JOB_SUBSTATE_TERMINATED: deleted by qdel
    status=130
    step "PBS job $id was deleted (qdel, or by an administrator) before it finished"
  elif ((code == -29)); then  # JOB_EXEC_KILL_WALLTIME
    status=124
    step "PBS job $id hit its walltime ($JOB_WALLTIME) and was killed: raise it (PBS_WALLTIME_${JOB_SHAPE^^} / --walltime)"
  elif ((code < 0)); then
    status=1
    step "PBS could not run job $id (Exit_status $code: see 'JOB_EXEC' codes in the PBS admin guide; comment: $(sed -n 's/^ *comment = //p' <<<"$info"))"
  elif ((code >= 256)); then  # killed by a signal: PBS reports 256 + the signal
    status=$((128 + code - 256))
    step "PBS job $id was killed by signal $((code - 256))"
  else
    status=$code
    ((code == 0)) || step "PBS job $id failed: exit status $code"
  fi
  job_show_log
  step "$JOB_NAME (PBS job $id) finished: exit status $status"
  exit "$status"
}

# job_pbs_delete ID QSUB_PID: qdel the job, stop the waiting qsub, and give PBS up to 30 s to copy the
# job's output back (so that its log can be shown).
job_pbs_delete() {
  qdel "$1" 2>/dev/null || true
  kill "$2" 2>/dev/null || true
  JOB_WAIT_TIMEOUT=30 job_wait "PBS job $1 to finish (state F)" job_pbs_finished "$1" || true
}
# qsub has printed a whole line (the job id, or its refusal), or has exited.
job_pbs_submitted() { [[ -s "$1" && $(tail -c 1 "$1" | wc -l) -eq 1 ]] || ! kill -0 "$2" 2>/dev/null; }
job_pid_gone() { ! kill -0 "$1" 2>/dev/null; }
job_pbs_finished() { [[ $(qstat -x -f "$1" 2>/dev/null | sed -n 's/^ *job_state = //p') == F ]]; }

# Slurm: submit, poll the job's state, then turn its final state and ExitCode into this script's exit
# status and a clear message.
job_run_slurm() {
  local out id info="" state exit_code status
  out=$("${JOB_SUBMIT_CMD[@]}") || die "sbatch refused the job (above); script: $JOB_SCRIPT"
  id=${out%%;*}
  [[ "$id" =~ ^[0-9]+$ ]] || die "sbatch printed '$out', not a job id"
  JOB_LOG=${JOB_LOG//%j/$id}
  step "submitted $JOB_NAME as Slurm job $id ($JOB_NODES node(s) x $JOB_PPN task(s), $JOB_CPUS cpu(s)/task, time $JOB_WALLTIME${JOB_QUEUE:+, partition $JOB_QUEUE}); log: $JOB_LOG"
  trap 'scancel "$id" 2>/dev/null; step "interrupted: cancelled Slurm job $id"; job_show_log; exit 130' INT TERM
  if ! job_wait "Slurm job $id" job_slurm_done "$id"; then
    scancel "$id" 2>/dev/null || true
    job_show_log
    die "gave up on Slurm job $id after JOB_WAIT_TIMEOUT=${JOB_WAIT_TIMEOUT}s (state $(job_slurm_state "$id")); it was cancelled"
  fi
  trap - INT TERM
  info=$(scontrol show job -o "$id" 2>&1) || die "scontrol show job $id failed: $info"
  state=$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"$info")
  exit_code=$(sed -n 's/.* ExitCode=\([0-9]*:[0-9]*\).*/\1/p' <<<"$info")
  local code=${exit_code%%:*} signal=${exit_code##*:}
  case "$state" in
    COMPLETED) status=0 ;;
    TIMEOUT) status=124
      step "Slurm job $id hit its time limit ($(sed -n 's/.* TimeLimit=\([^ ]*\).*/\1/p' <<<"$info")) and was killed: raise the time (SLURM_TIME_${JOB_SHAPE^^} / --walltime)" ;;
    CANCELLED) status=130
      step "Slurm job $id was cancelled (scancel, or by an administrator) before it finished" ;;
    OUT_OF_MEMORY) status=137; step "Slurm job $id ran out of memory" ;;
    FAILED) status=$((code > 0 ? code : (signal > 0 ? 128 + signal : 1)))
      step "Slurm job $id failed: exit code $code$( ((signal > 0)) && echo ", signal $signal")" ;;
    *) status=1; step "Slurm job $id ended in state $state (reason: $(sed -n 's/.* Reason=\([^ ]*\).*/\1/p' <<<"$info"))" ;;
  esac
  job_show_log
  step "$JOB_NAME (Slurm job $id) finished: $state, exit status $status"
  exit "$status"
}

job_slurm_state() { scontrol show job -o "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
job_slurm_done() {
  local state
  state=$(job_slurm_state "$1")
  [[ -n "$state" ]] || die "scontrol show job $1 failed"
  [[ "$SLURM_DONE_STATES" == *" $state "* ]]
}
