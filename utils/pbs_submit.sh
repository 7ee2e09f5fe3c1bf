#!/usr/bin/env bash
# Run a command on compute nodes through PBS, wait for it, and exit with its exit status.
#
#   utils/pbs_submit.sh --name NAME --shape build|test [--select SELECT] [--walltime HH:MM:SS] \
#                       [--queue Q] [--account A] [--submit qcmd|qsub] -- COMMAND [ARG...]
#
# Defaults come from the site profile through config_env.sh (TORCHHPC_PBS_*, themselves overridable as
# PBS_ACCOUNT, PBS_QUEUE, PBS_SELECT_BUILD, PBS_WALLTIME_BUILD, PBS_SELECT_TEST, PBS_WALLTIME_TEST,
# PBS_EXTRA, PBS_SUBMIT); --shape picks the build or the test resources.  The job script
# ($TORCHHPC_PREFIX/jobs/NAME.pbs) re-sources config_env.sh for the same SITE and PYTORCH_VERSION on the
# compute node, then runs COMMAND from the repository root.
#   qsub:  `qsub -W block=true SCRIPT`: PBS Pro returns only when the job ends, with the job's exit status.
#   qcmd:  NCAR's blocking wrapper; the resources go on its command line (it does not read #PBS lines).
# DRY_RUN=1 prints the job script and the exact submit command instead of submitting.
set -euo pipefail
# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

name="" shape="" select="" walltime="" queue="" account="" submit=""
while (($#)); do
  case "$1" in
    --name) name=${2:?--name needs a value}; shift 2 ;;
    --shape) shape=${2:?--shape needs a value}; shift 2 ;;
    --select) select=${2:?--select needs a value}; shift 2 ;;
    --walltime) walltime=${2:?--walltime needs a value}; shift 2 ;;
    --queue) queue=${2:?--queue needs a value}; shift 2 ;;
    --account) account=${2:?--account needs a value}; shift 2 ;;
    --submit) submit=${2:?--submit needs a value}; shift 2 ;;
    --) shift; break ;;
    *) die "unknown option '$1' (see the header of $0)" ;;
  esac
done
(($#)) || die "no command given after --"
[[ "$name" =~ ^[A-Za-z][A-Za-z0-9._-]{0,235}$ ]] || die "--name '$name' is not a valid PBS job name"
TORCHHPC_NO_ENV=1 TORCHHPC_NO_MODULES=1 TORCHHPC_QUIET=1 load_config
case "$shape" in
  build) select=${select:-$TORCHHPC_PBS_SELECT_BUILD} walltime=${walltime:-$TORCHHPC_PBS_WALLTIME_BUILD} ;;
  test) select=${select:-$TORCHHPC_PBS_SELECT_TEST} walltime=${walltime:-$TORCHHPC_PBS_WALLTIME_TEST} ;;
  "") ;;
  *) die "--shape '$shape' is not build or test" ;;
esac
[[ "$select" =~ ^[0-9]+(:[a-z_]+=[^:]+)*$ ]] || die "--select '$select' is not a PBS select statement (N:key=value:...)"
[[ "$walltime" =~ ^[0-9]+:[0-5][0-9]:[0-5][0-9]$ ]] || die "--walltime '$walltime' is not HH:MM:SS"
queue=${queue:-$TORCHHPC_PBS_QUEUE}
account=${account:-$TORCHHPC_PBS_ACCOUNT}
submit=${submit:-$TORCHHPC_SUBMIT}
case "$submit" in qcmd | qsub) ;; *) die "--submit '$submit' is not qcmd or qsub" ;; esac
if [[ -z "$account" ]]; then
  if [[ "$TORCHHPC_PBS_ACCOUNT_REQUIRED" == 1 && "$DRY_RUN" != 1 ]]; then
    die "site $TORCHHPC_SITE needs a project account: PBS_ACCOUNT=<project code> make ..."
  fi
fi
read -r -a extra <<<"${TORCHHPC_PBS_EXTRA:-}"

jobs_dir="$TORCHHPC_PREFIX/jobs"
script="$jobs_dir/$name.pbs"
log="$jobs_dir/$name.log"
command_line=$(quote_cmd "$@")

directives=("#PBS -N $name")
[[ -n "$account" ]] && directives+=("#PBS -A $account")
directives+=("#PBS -q $queue" "#PBS -l select=$select" "#PBS -l walltime=$walltime" "#PBS -j oe" "#PBS -o $log")
((${#extra[@]})) && directives+=("#PBS ${extra[*]}")

job_script=$(
  printf '#!/bin/bash -l\n'
  printf '%s\n' "${directives[@]}"
  cat <<JOB
# Written by utils/pbs_submit.sh for site $TORCHHPC_SITE; runs from the repository root.
set -euo pipefail
cd $(printf '%q' "$TORCHHPC_ROOT")
export SITE=$(printf '%q' "$TORCHHPC_SITE") PYTORCH_VERSION=$(printf '%q' "$PYTORCH_VERSION") TORCHHPC_PREFIX=$(printf '%q' "$TORCHHPC_PREFIX")
echo "job \${PBS_JOBID:-?} on \$(hostname) at \$(date -u +%FT%TZ)"
printf 'command: %s\n' $(printf '%q' "$command_line")
$command_line
JOB
)

if [[ "$submit" == qcmd ]]; then
  submit_cmd=(qcmd -N "$name" -q "$queue" -l "select=$select" -l "walltime=$walltime")
  [[ -n "$account" ]] && submit_cmd+=(-A "$account")
  # A login shell, as the #!/bin/bash -l line gives qsub jobs: the module command must be there.
  submit_cmd+=("${extra[@]}" -- bash -l "$script")
else
  submit_cmd=(qsub -W block=true "$script")
fi

if [[ "$DRY_RUN" == 1 ]]; then
  echo "# job script $script:"
  printf '%s\n' "$job_script"
  echo "# submit command:"
  quote_cmd "${submit_cmd[@]}"
  [[ -n "$account" ]] || echo "# warning: no account; set PBS_ACCOUNT before submitting for real" >&2
  exit 0
fi

command -v "${submit_cmd[0]}" >/dev/null || die "'${submit_cmd[0]}' not found: submit from a PBS login node"
mkdir -p "$jobs_dir"
printf '%s\n' "$job_script" >"$script"
step "submitting $name ($select, $walltime, queue $queue) with ${submit_cmd[0]}; log: $log"
status=0
"${submit_cmd[@]}" || status=$?
[[ -f "$log" && "$submit" == qsub ]] && tail -n 40 "$log"
step "$name finished with exit status $status"
exit "$status"
