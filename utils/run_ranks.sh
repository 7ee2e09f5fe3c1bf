#!/usr/bin/env bash
# Inside a PBS or Slurm job (written by `torchhpc jobscript`): activate the site's environment and runtime
# settings (config_env.sh), then run COMMAND once per rank across the allocation with the site's launcher,
# from the directory this script was started in.
#
#   [LAUNCHER=mpiexec|srun] [DRY_RUN=1] [TORCHHPC_SPARE_NODES=K] utils/run_ranks.sh COMMAND [ARG...]
#
# Nodes, ranks per node and the launcher line: utils/lib/launch.sh.
#
# Spare nodes (TORCHHPC_SPARE_NODES=K, written by `torchhpc jobscript --spare-nodes K` into a job of N+K nodes):
# this script supervises the step.  It runs COMMAND on the first N nodes that answer a probe (launch_probe);
# when the step ends it probes the step's nodes again: if one no longer answers, it is left out for good and
# the step starts again at once on N answering nodes, a spare in its place (COMMAND resumes from its own newest
# checkpoint); after K nodes lost, or when fewer than N answer, it exits with the step's status, for the
# scheduler's requeue.  A step that fails with every node answering is the program's failure: no restart.
set -euo pipefail
# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=utils/lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
(($#)) || die "no command given: utils/run_ranks.sh COMMAND [ARG...]"
workdir=$PWD
load_config
cd "$workdir"
spare=${TORCHHPC_SPARE_NODES:-0}
[[ "$spare" =~ ^[0-9]+$ ]] || die "TORCHHPC_SPARE_NODES='$spare' is not a whole number"

# The hosts among "$@" that answer the probe, in the order given (probed side by side).
answering() {
  local host marks
  marks=$(mktemp -d)
  for host; do (launch_probe "$host" && touch "$marks/$host") & done
  wait
  for host; do [[ ! -e "$marks/$host" ]] || printf '%s\n' "$host"; done
  rm -rf "$marks"
}

if ((spare == 0)) || [[ "$DRY_RUN" == 1 ]]; then
  launch_resolve
  step "$LAUNCH_NODES node(s) x $LAUNCH_PPN rank(s) with $TORCHHPC_LAUNCHER in $workdir; bound: $LAUNCH_BIND"
  run "${LAUNCH[@]}" "$@"
  exit 0
fi

mapfile -t allocated < <(launch_hosts)
need=$((${#allocated[@]} - spare)) lost=() status=0
((need >= 1)) || die "TORCHHPC_SPARE_NODES=$spare leaves none of the job's ${#allocated[@]} node(s) for the step"
launch_flavor  # once, before the probes' subshells
while :; do
  hosts=()
  for host in "${allocated[@]}"; do [[ " ${lost[*]} " == *" $host "* ]] || hosts+=("$host"); done
  mapfile -t healthy < <(answering "${hosts[@]}")
  if ((${#healthy[@]} < need)); then
    step "${#healthy[@]} of the job's nodes answer (${healthy[*]:-none}; lost: ${lost[*]:-none}), $need needed:" \
      "ending the job (exit $((status ? status : 1))) for the scheduler's requeue"
    exit "$((status ? status : 1))"
  fi
  LAUNCH_HOSTS="${healthy[*]:0:need}"
  launch_resolve
  step "$LAUNCH_NODES node(s) x $LAUNCH_PPN rank(s) with $TORCHHPC_LAUNCHER in $workdir on $LAUNCH_HOSTS" \
    "(spare: $((${#healthy[@]} - need)); lost: ${lost[*]:-none}); bound: $LAUNCH_BIND"
  status=0
  run "${LAUNCH[@]}" "$@" || status=$?
  # probed even after a success: Open MPI's mpiexec exits 0 when it loses a node's daemon mid-run
  started=$SECONDS
  read -r -a used <<<"$LAUNCH_HOSTS"
  mapfile -t alive < <(answering "${used[@]}")
  dead=()
  for host in "${used[@]}"; do [[ " ${alive[*]} " == *" $host "* ]] || dead+=("$host"); done
  if ((${#dead[@]} == 0)); then
    ((status == 0)) && exit 0
    step "the step failed (exit $status) with every node answering: the program's failure, not a node's; no restart"
    exit "$status"
  fi
  seen=$status
  ((status != 0)) || status=1  # a lost node is a failure, whatever the launcher said
  lost+=("${dead[@]}")
  if ((${#lost[@]} > spare)); then
    step "node(s) ${lost[*]} lost, more than the $spare spare(s): ending the job (exit $status) for the scheduler's requeue"
    exit "$status"
  fi
  LAUNCH_OVERLAP=1
  step "node(s) ${dead[*]} stopped answering (step exit $seen; probed in $((SECONDS - started)) s): restarting" \
    "in place without them, ${#lost[@]} of $spare spare(s) used"
done
