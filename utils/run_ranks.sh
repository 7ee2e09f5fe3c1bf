#!/usr/bin/env bash
# Inside a PBS or Slurm job (written by `torchhpc jobscript`): activate the site's environment and runtime
# settings (config_env.sh), then run COMMAND once per rank across the allocation with the site's launcher,
# from the directory this script was started in.
#
#   [LAUNCHER=mpiexec|srun] [DRY_RUN=1] utils/run_ranks.sh COMMAND [ARG...]
#
# Nodes, ranks per node and the launcher line: utils/lib/launch.sh.
set -euo pipefail
# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=utils/lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"
(($#)) || die "no command given: utils/run_ranks.sh COMMAND [ARG...]"
workdir=$PWD
load_config
cd "$workdir"
launch_resolve
step "$LAUNCH_NODES node(s) x $LAUNCH_PPN rank(s) with $TORCHHPC_LAUNCHER in $workdir; bound: $LAUNCH_BIND"
run "${LAUNCH[@]}" "$@"
