#!/usr/bin/env bash
# Run a command on compute nodes through the site's batch scheduler (PBS or Slurm), wait for it with its
# progress shown, show its log and exit with its exit status.  One job script generator for both schedulers.
#
#   utils/submit_job.sh --name NAME --shape build|test|run [--scheduler pbs|slurm] [--walltime HH:MM:SS]
#                       [--account A] [--queue Q] [--nodes N] [--ranks-per-node N] [--cpus N] [--gpus N]
#                       [--select PBS_SELECT] [--submit qcmd|qsub] [--workdir DIR] [--detach]
#                       [--print-script] [--record FILE] [--spare-nodes K] -- COMMAND [ARG...]
#   utils/submit_job.sh --attach NAME      follow a job submitted earlier (e.g. with --detach) to its end
#
# The scheduler is --scheduler, else SCHEDULER, else the site profile's SITE_SCHEDULER (`generic` detects
# sbatch or qsub on PATH).  Resources come from the site profile through config_env.sh (TORCHHPC_PBS_* and
# TORCHHPC_SLURM_*, each overridable as PBS_* / SLURM_* variables, see docs/cluster.md); --shape picks the
# build, the test or the run set (run: the user's command, `torchhpc jobscript`).  The job script
# ($TORCHHPC_PREFIX/jobs/NAME.pbs|.slurm) exports SITE, PYTORCH_VERSION and the knobs set here, then runs
# COMMAND in --workdir (default: the repository root); the commands it runs load config_env.sh themselves.
#   PBS:   `qsub SCRIPT`; the job writes its log on the shared file system as it goes; `qstat -x` is polled
#          until the job ends and gives its exit status.  Or NCAR's blocking `qcmd` (resources on its
#          command line: it does not read #PBS lines; it streams the job's output).
#   Slurm: `sbatch --parsable SCRIPT`, then `scontrol show job` polled until the job ends; the job's state
#          and exit code come from there.
# While waiting, a line shows the job's state, time queued or running and its log's latest line (ninja's
# [N/M] as a percentage).  Ctrl-C (or a kill) deletes the job; --detach (DETACH=1) submits and returns, and
# --attach NAME (`make job-wait JOB=NAME`) follows it later.  --record FILE appends the job's record (scheduler,
# id, log) to FILE as well, one line per submission (torchhpc.submit follows its jobs there).  --spare-nodes K
# (run shape) asks for K nodes beyond --nodes, kept by the allocation when one fails (Slurm --no-kill, PBS
# tolerate_node_failures=all); utils/run_ranks.sh restarts the step on a spare in place of a lost node.
# Exit status: the job's; 124 when it hit its time limit; 130 when cancelled; 1 for other failures.
# DRY_RUN=1 prints the job script and the exact submit command instead of submitting; --print-script prints
# only the script.
set -euo pipefail
# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=utils/lib/jobs.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/jobs.sh"

JOB_NAME="" JOB_SHAPE="" JOB_SCHEDULER=${SCHEDULER:-} JOB_WALLTIME="" JOB_ACCOUNT="" JOB_QUEUE=""
JOB_NODES="" JOB_PPN="" JOB_CPUS="" JOB_GPUS="" JOB_SELECT="" JOB_SUBMIT="" JOB_WORKDIR="" JOB_DETACH=${DETACH:-0}
JOB_ATTACH="" JOB_PRINT=0 JOB_RECORD_TO="" JOB_SPARE=0
while (($#)); do
  case "$1" in
    --name) JOB_NAME=${2:?--name needs a value}; shift 2 ;;
    --shape) JOB_SHAPE=${2:?--shape needs a value}; shift 2 ;;
    --scheduler) JOB_SCHEDULER=${2:?--scheduler needs a value}; shift 2 ;;
    --walltime) JOB_WALLTIME=${2:?--walltime needs a value}; shift 2 ;;
    --account) JOB_ACCOUNT=${2:?--account needs a value}; shift 2 ;;
    --queue | --partition) JOB_QUEUE=${2:?$1 needs a value}; shift 2 ;;
    --nodes) JOB_NODES=${2:?--nodes needs a value}; shift 2 ;;
    --ranks-per-node) JOB_PPN=${2:?--ranks-per-node needs a value}; shift 2 ;;
    --cpus) JOB_CPUS=${2:?--cpus needs a value}; shift 2 ;;
    --gpus) JOB_GPUS=${2:?--gpus needs a value}; shift 2 ;;
    --select) JOB_SELECT=${2:?--select needs a value}; shift 2 ;;
    --submit) JOB_SUBMIT=${2:?--submit needs a value}; shift 2 ;;
    --workdir) JOB_WORKDIR=${2:?--workdir needs a value}; shift 2 ;;
    --detach) JOB_DETACH=1; shift ;;
    --attach) JOB_ATTACH=${2:?--attach needs a job name}; shift 2 ;;
    --print-script) JOB_PRINT=1; shift ;;
    --record) JOB_RECORD_TO=${2:?--record needs a file}; shift 2 ;;
    --spare-nodes) JOB_SPARE=${2:?--spare-nodes needs a value}; shift 2 ;;
    --) shift; break ;;
    *) die "unknown option '$1' (see the header of $0)" ;;
  esac
done
if [[ -n "$JOB_ATTACH" ]]; then
  TORCHHPC_NO_ENV=1 TORCHHPC_NO_MODULES=1 TORCHHPC_QUIET=1 load_config
  job_attach "$JOB_ATTACH"
fi
(($#)) || die "no command given after --"
JOB_COMMAND=$(quote_cmd "$@")
# a printed script is submitted by hand, with qsub: the job writes its own log as it goes
[[ "$JOB_PRINT" == 1 ]] && JOB_SUBMIT=${JOB_SUBMIT:-qsub}
JOB_EXPORTS=$(job_exports)  # the knobs as the user set them, before config_env.sh derives its own
TORCHHPC_NO_ENV=1 TORCHHPC_NO_MODULES=1 TORCHHPC_QUIET=1 load_config

job_resolve
# a build on a CUDA older than its PyTorch release was made for fails hours in: say so before submitting
if [[ "$JOB_SHAPE" == build && "${CUDA_MISMATCH_OK:-0}" != 1 ]]; then
  unfit=$(cuda_unfit "$PYTORCH_VERSION")
  if [[ -n "$unfit" && "$DRY_RUN" == 1 ]]; then echo "# warning: $unfit" >&2; elif [[ -n "$unfit" ]]; then die "$unfit"; fi
fi
job_write_script
job_build_submit
if [[ "$JOB_PRINT" == 1 ]]; then
  printf '%s\n' "$JOB_SCRIPT_TEXT"
  exit 0
fi
if [[ "$DRY_RUN" == 1 ]]; then
  echo "# job script $JOB_SCRIPT:"
  printf '%s\n' "$JOB_SCRIPT_TEXT"
  echo "# submit command:"
  quote_cmd "${JOB_SUBMIT_CMD[@]}"
  [[ -n "$JOB_ACCOUNT" ]] || echo "# warning: no account; set ${JOB_SCHEDULER^^}_ACCOUNT before submitting for real" >&2
  exit 0
fi
job_run
