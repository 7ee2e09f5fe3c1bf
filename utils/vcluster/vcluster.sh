#!/usr/bin/env bash
# A virtual cluster on this host: N nodes, each a Linux network, UTS, mount and IPC namespace (its own
# hostname, System V IPC, /tmp, /dev/shm and /run, one address on a veth joined to the others by a bridge),
# with a real batch scheduler across them: Slurm (munged on every node, slurmctld on node1, one slurmd per
# node) or OpenPBS (server, scheduler and comm on node1, one pbs_mom per node; built by build_openpbs.sh).
# The project's directory stays shared, like a cluster's parallel file system.  Needs root, iproute2 and
# util-linux.
#
#   vcluster.sh up N [slurm|pbs]
#                             build N nodes and start the scheduler (default slurm; a no-op when the same
#                             cluster is up and healthy)
#   vcluster.sh down          stop everything and remove every namespace, link and file it made
#   vcluster.sh exec [-n NODE] CMD...
#                             run CMD on NODE (default node1) as a user on a login node would: the
#                             scheduler's clients and the project's venv on PATH, the project's directory
#                             as cwd
#   vcluster.sh shell [NODE]  an interactive login shell there
#   vcluster.sh status        the nodes, their addresses and `sinfo` or `pbsnodes`
#   vcluster.sh link RATE     shape every node's link with tc's token bucket (e.g. 10gbit, 1gbit; `none` clears)
#   vcluster.sh kill-node NODE
#                             a node failure: its link is cut and every process in it killed
#   vcluster.sh revive-node NODE
#                             the failed node boots again: fresh namespaces, its daemons, back in service
#   vcluster.sh cut-link NODE | restore-link NODE
#                             a node that goes silent while everything in it lives: its link down, then up
#   vcluster.sh signal-node NODE SIGNAL PATTERN
#                             send SIGNAL (STOP, CONT, ...) to the node's processes whose command line
#                             matches PATTERN (the nodes share one PID space: pkill would reach every node)
#
# Variables: VCLUSTER_DIR (shared state, default $TORCHHPC_PREFIX/vcluster or build/vcluster), VENV (.venv),
# VCLUSTER_SUBNET (first three octets, default 10.212.0), VCLUSTER_CPUS (CPUs each node declares to
# Slurm and PBS, default this host's core count), OPENPBS_PREFIX (where build_openpbs.sh installs OpenPBS).
# Inside the cluster `ssh NODE CMD` enters NODE the same way (bin/ssh in the state directory), so
# `mpiexec --host node1:2,node2:2` launches across nodes.  Login shells on the nodes (PBS jobs, `bash -l`)
# read the cluster's /etc/profile.d, which sources the same login environment (profile.sh).
set -Eeuo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
prefix=${TORCHHPC_PREFIX:-$repo/build}
dir=${VCLUSTER_DIR:-$prefix/vcluster}
venv=${VENV:-.venv}
[[ "$venv" = /* ]] || venv="$repo/$venv"
subnet=${VCLUSTER_SUBNET:-10.212.0}
pbs_exec=${OPENPBS_PREFIX:-$prefix/openpbs}
ns_prefix=torchhpc
switch_ns=$ns_prefix-switch

die() { printf 'vcluster: error: %s\n' "$*" >&2; exit 1; }
say() { printf 'vcluster: %s\n' "$*" >&2; }

# Nodes of the cluster that is up, in order (from the state directory).
nodes() { [[ -f "$dir/nodes.list" ]] && cat "$dir/nodes.list"; return 0; }

# The scheduler of the cluster that is up (slurm or pbs).
scheduler() { cat "$dir/scheduler" 2>/dev/null || echo slurm; }

node_pid() {
  local pid
  pid=$(cat "$dir/nodes/$1.pid" 2>/dev/null) || die "no node '$1' in the virtual cluster (have: $(nodes | xargs))"
  [[ -d /proc/$pid ]] || die "node '$1' is down (its namespace holder $pid is gone)"
  printf '%s\n' "$pid"
}

# enter NODE CMD...: run CMD inside NODE's namespaces with a login environment.
enter() {
  local pid
  pid=$(node_pid "$1")
  shift
  # shellcheck disable=SC2016  # the script is for the node's shell
  nsenter -t "$pid" -n -u -m -i -- env -i HOME="${HOME:-/root}" TERM="${TERM:-dumb}" LANG=C.UTF-8 \
    bash -c '. "$0" && cd "$1" && shift && exec "$@"' "$dir/profile.sh" "$repo" "$@"
}

# unfit WHY: this host cannot carry a virtual cluster (exit 3, which tests read as "skip", not "fail").
unfit() { printf 'vcluster: cannot run here: %s\n' "$*" >&2; exit 3; }

preflight() {
  local sched=$1 tool
  [[ $(id -u) -eq 0 ]] || unfit "needs root (network namespaces, mounts, the scheduler's daemons)"
  for tool in ip nsenter unshare tc; do command -v "$tool" >/dev/null || unfit "'$tool' not found (iproute2, util-linux)"; done
  if [[ "$sched" == slurm ]]; then
    for tool in munged slurmctld slurmd sinfo srun; do
      command -v "$tool" >/dev/null || unfit "'$tool' not found: apt-get install slurm-wlm munge"
    done
  else
    id postgres >/dev/null 2>&1 || unfit "no 'postgres' user for the PBS server's datastore: apt-get install postgresql"
    OPENPBS_PREFIX=$pbs_exec bash "$here/build_openpbs.sh"  # a no-op once built; exit 3 where it cannot be
  fi
  [[ -x "$venv/bin/python" ]] || die "no venv at $venv: run 'make env' first"
  ip netns add "$ns_prefix-probe" 2>/dev/null || unfit "cannot create a network namespace here (ip netns add)"
  ip netns del "$ns_prefix-probe"
}

write_files() {
  local n=$1 sched=$2 i
  mkdir -p "$dir"/{nodes,log,bin,profile.d}
  echo "$sched" >"$dir/scheduler"
  : >"$dir/nodes.list"
  {
    printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n'
    for ((i = 1; i <= n; i++)); do printf '%s.%d\tnode%d\n' "$subnet" "$i" "$i"; done
  } >"$dir/hosts"
  for ((i = 1; i <= n; i++)); do echo "node$i" >>"$dir/nodes.list"; done
  ln -sfn "$here/ssh" "$dir/bin/ssh"
  # The login environment of every node: what a site's /etc/profile.d and the user's ~/.bashrc would set.
  cat >"$dir/profile.sh" <<EOF
# torchhpc virtual cluster: login environment (written by utils/vcluster/vcluster.sh)
export PATH="$dir/bin:$venv/bin:$([[ "$sched" == pbs ]] && echo "$pbs_exec/bin:")/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
export VIRTUAL_ENV="$venv"
export TORCHHPC_VCLUSTER="$dir"
# Open MPI refuses root without these; the nodes share this host's cores, so nothing is bound to a core.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_hwloc_default_binding_policy=none
# The nodes share one kernel and one PID space, so UCX's cross-memory-attach transport (process_vm_readv)
# would reach another node's memory without the network: Open MPI's UCX-based components are off, as on
# an Ethernet cluster (one-sided MPI then runs osc/rdma over the tcp BTL).
export OMPI_MCA_osc=^ucx OMPI_MCA_btl=^uct OMPI_MCA_pml=^ucx
EOF
  if [[ "$sched" == slurm ]]; then
    printf 'export SLURM_CONF="%s"\n' "$dir/slurm.conf" >>"$dir/profile.sh"
    write_slurm_conf "$n"
  else
    # shellcheck disable=SC2016  # $(hostname) is for the node's shell
    printf '# this node'"'"'s PBS configuration (its PBS_HOME is node-local)\nexport PBS_CONF_FILE="%s/pbs/$(hostname).conf"\n' \
      "$dir" >>"$dir/profile.sh"
    write_pbs_conf "$n"
  fi
  printf '# torchhpc virtual cluster: the user'"'"'s dotfile (the login environment is in /etc/profile.d)\n' \
    >"$dir/dotfile"
  # The nodes' /etc/profile.d: the host's, and the cluster's login environment for login shells (PBS jobs)
  cp -a /etc/profile.d/. "$dir/profile.d/" 2>/dev/null || true
  printf '# torchhpc virtual cluster\n. "%s"\n' "$dir/profile.sh" >"$dir/profile.d/zz-torchhpc-vcluster.sh"
}

write_slurm_conf() {
  local n=$1 i cpus=${VCLUSTER_CPUS:-$(nproc)}
  mkdir -p "$dir"/{slurm/state,munge}
  chmod 0700 "$dir/munge"
  [[ -f "$dir/munge/munge.key" ]] || { head -c 1024 /dev/urandom >"$dir/munge/munge.key"; chmod 0400 "$dir/munge/munge.key"; }
  {
    cat <<EOF
# torchhpc virtual cluster: $n nodes (written by utils/vcluster/vcluster.sh)
ClusterName=torchhpc-vc
SlurmctldHost=node1($subnet.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$dir/slurm/state
SlurmdSpoolDir=/run/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
# srun binds tasks to the cores it asks for (--cpu-bind), as on a cluster's nodes
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=10
KillWait=5
MinJobAge=600
# a job on a failed node is reported failed (NODE_FAIL), not requeued behind the user's back
JobRequeue=0
# a job that asks for it (sbatch --requeue) starts again this long after its node failed (Slurm's default: 120 s)
AuthInfo=cred_expire=10
EOF
    for ((i = 1; i <= n; i++)); do
      printf 'NodeName=node%d NodeAddr=%s.%d CPUs=%d State=UNKNOWN\n' "$i" "$subnet" "$i" "$cpus"
    done
    printf 'PartitionName=vc Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4\n'
  } >"$dir/slurm.conf"
}

# One pbs.conf per node (PBS_CONF_FILE in the login environment points each node at its own): node1 runs
# the server, scheduler and comm, every node a mom; PBS_HOME is node-local, as /var/spool/pbs is on a site.
write_pbs_conf() {
  local n=$1 i first
  mkdir -p "$dir/pbs"
  for ((i = 1; i <= n; i++)); do
    first=$((i == 1 ? 1 : 0))
    cat >"$dir/pbs/node$i.conf" <<EOF
PBS_EXEC=$pbs_exec
PBS_HOME=/run/pbs
PBS_SERVER=node1
PBS_START_SERVER=$first
PBS_START_SCHED=$first
PBS_START_COMM=$first
PBS_START_MOM=1
PBS_CORE_LIMIT=unlimited
EOF
  done
}

# Runs inside a new UTS + mount namespace (see make_node): the node's own hostname, /tmp, /dev/shm, /run
# and /etc/hosts; then it holds the namespaces open.
node_init() {
  local name=$1
  hostname "$name"
  mount --make-rprivate /
  mount -t tmpfs -o mode=1777 tmpfs /tmp
  mount -t tmpfs -o mode=1777 tmpfs /dev/shm
  mount -t tmpfs -o mode=0755 tmpfs /run
  mkdir -p /run/munge /run/slurmd
  # what systemd-tmpfiles would make at boot: PostgreSQL's socket directory (the PBS server's datastore)
  if id postgres >/dev/null 2>&1; then install -d -m 2775 -o postgres -g postgres /run/postgresql; fi
  # /sys of this node's network namespace (its /sys/class/net), keeping the host's cgroup mounts for slurmd
  mkdir /tmp/.sys
  mount -t sysfs sysfs /tmp/.sys
  if [[ -d /sys/fs/cgroup ]]; then mount --rbind /sys/fs/cgroup /tmp/.sys/fs/cgroup; fi
  umount -l /sys
  mount --move /tmp/.sys /sys
  rmdir /tmp/.sys 2>/dev/null || true
  mount --bind "$dir/hosts" /etc/hosts
  mount --bind "$dir/profile.d" /etc/profile.d
  # The cluster user's own dotfiles, not this host's: login shells (PBS jobs) must not run the host's
  # ~/.bashrc, whose pyenv init takes a lock that a job killed mid-login leaves behind for every later one.
  local f
  for f in .bashrc .profile .bash_profile .bash_login; do
    if [[ -f "${HOME:-/root}/$f" ]]; then mount --bind "$dir/dotfile" "${HOME:-/root}/$f"; fi
  done
  echo $$ >"$dir/nodes/$name.pid"
  exec sleep infinity
}

make_node() {
  local i=$1 name="node$1" ns="$ns_prefix-node$1"
  ip netns add "$ns"
  ip -n "$switch_ns" link add "port$i" type veth peer name eth0 netns "$ns"
  ip -n "$switch_ns" link set "port$i" master br0 up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$subnet.$i/24" dev eth0
  ip -n "$ns" link set eth0 up
  rm -f "$dir/nodes/$name.pid"
  setsid nsenter --net="/run/netns/$ns" unshare --uts --mount --ipc --fork \
    bash "$here/vcluster.sh" _node-init "$name" </dev/null >"$dir/log/$name.init.log" 2>&1 &
  wait_for "node $name" 10 test -s "$dir/nodes/$name.pid"
}

# wait_for WHAT SECONDS CMD...: poll CMD (0.1 s growing to 1 s) until it succeeds; fail after SECONDS.
wait_for() {
  local what=$1 limit=$2 interval=0.1 start=$SECONDS
  shift 2
  until "$@" >/dev/null 2>&1; do
    ((SECONDS - start < limit)) || { say "$what: not ready after ${limit}s"; return 1; }
    sleep "$interval"
    interval=$(awk -v i="$interval" 'BEGIN { i *= 2; print (i > 1 ? 1 : i) }')
  done
}

sinfo_idle() {
  local n
  n=$(enter node1 sinfo -h -N -t idle -o '%N' | sort -u | wc -l)
  [[ "$n" -eq $(nodes | wc -l) ]]
}

# slurm_daemons NODE: what a node of the Slurm cluster runs (munged, slurmd; node1 also slurmctld).
slurm_daemons() {
  local node=$1
  enter "$node" munged --force --key-file="$dir/munge/munge.key" --log-file="$dir/log/munged-$node.log" \
    --seed-file=/run/munge/seed
  wait_for "munged on $node" 15 enter "$node" test -S /run/munge/munge.socket.2
  if [[ "$node" == node1 ]]; then enter node1 slurmctld -i; fi
  enter "$node" slurmd
}

start_slurm() {
  local node
  for node in $(nodes); do slurm_daemons "$node"; done
  wait_for "all nodes idle in sinfo" 60 sinfo_idle
}

pbs_all_free() {
  local n
  n=$(enter node1 pbsnodes -a | grep -c '^ *state = free$')
  [[ "$n" -eq $(nodes | wc -l) ]]
}

# OpenPBS as a site runs it: PBS_HOME made on every node (pbs_habitat), the daemons started by pbs_init.d;
# then the server is set up with qmgr as an administrator would.
start_pbs() {
  local node
  for node in $(nodes); do pbs_habitat "$node"; done
  enter node1 env LANG=C "$pbs_exec/libexec/pbs_init.d" start >"$dir/log/pbs-start-node1.log" 2>&1
  wait_for "PBS server on node1" 60 enter node1 qstat -B
  # Jobs run as root here (the only user of this host): the server accepts root's jobs only when told to.
  # Finished jobs stay visible (qstat -x) for their exit status.
  enter node1 qmgr -c "set server acl_roots = root"
  enter node1 qmgr -c "set server job_history_enable = true"
  # A rerunnable job on a node whose mom stopped answering is requeued after this many seconds (default 310).
  enter node1 qmgr -c "set server node_fail_requeue = 15"
  for node in $(nodes); do
    enter node1 qmgr -c "list node $node" >/dev/null 2>&1 || enter node1 qmgr -c "create node $node"
  done
  for node in $(nodes | tail -n +2); do pbs_start "$node"; done
  wait_for "all nodes free in pbsnodes" 60 pbs_all_free
  wait_for "the PBS server to accept root's jobs" 30 pbs_takes_jobs
}

# pbs_habitat NODE: the node's PBS_HOME, its mom told that the server's host may command it and that job
# files go to the shared file system by cp ($usecp, instead of scp).
pbs_habitat() {
  local node=$1
  enter "$node" env LANG=C "$pbs_exec/libexec/pbs_habitat" >"$dir/log/pbs-habitat-$node.log" 2>&1
  # every path but the node-local /tmp, /run and /dev/shm is on the one shared file system
  # shellcheck disable=SC2016  # the mom's own syntax
  printf '$clienthost node1\n$usecp *:/ /\n' | enter "$node" tee -a /run/pbs/mom_priv/config >/dev/null
}

# pbs_start NODE: the node's PBS daemons (node1: server, scheduler, comm and mom; the others a mom).
pbs_start() {
  enter "$1" env LANG=C "$pbs_exec/libexec/pbs_init.d" start >"$dir/log/pbs-start-$1.log" 2>&1
}

# A held job of root's is accepted (then deleted with its history): the server is ready for users.
pbs_takes_jobs() {
  local job
  job=$(echo true | enter node1 qsub -h -N vcluster-probe) || return 1
  enter node1 qdel -x "$job"
}

healthy() {
  local n=$1 sched=$2 node
  [[ -f "$dir/nodes.list" && $(nodes | wc -l) -eq $n && $(scheduler) == "$sched" ]] || return 1
  for node in $(nodes); do [[ -d /proc/$(cat "$dir/nodes/$node.pid" 2>/dev/null || echo none) ]] || return 1; done
  if [[ "$sched" == slurm ]]; then sinfo_idle 2>/dev/null; else pbs_all_free 2>/dev/null; fi
}

cmd_up() {
  local n=${1:-2} sched=${2:-slurm} i
  [[ "$n" =~ ^[0-9]+$ && "$n" -ge 1 && "$n" -le 64 ]] || die "NODES must be a whole number from 1 to 64, got '$n'"
  [[ "$sched" == slurm || "$sched" == pbs ]] || die "SCHEDULER must be slurm or pbs, got '$sched'"
  preflight "$sched"
  if healthy "$n" "$sched"; then say "already up: $n nodes, $sched, all idle"; cmd_status; return 0; fi
  cmd_down quiet
  # the step that failed (its command, line and the functions it ran in), then the daemons' logs, then a clean host
  trap 'say "bring-up failed at vcluster.sh:$LINENO in ${FUNCNAME[*]:-main}: $BASH_COMMAND; logs:";
        tail -n 15 "$dir"/log/*.log >&2 || true; cmd_down quiet' ERR
  write_files "$n" "$sched"
  ip netns add "$switch_ns"
  ip -n "$switch_ns" link add br0 type bridge
  ip -n "$switch_ns" link set br0 up
  for ((i = 1; i <= n; i++)); do make_node "$i"; done
  if [[ "$sched" == slurm ]]; then start_slurm; else start_pbs; fi
  trap - ERR
  say "up: $n nodes, $sched"
  cmd_status
}

# kill_ns NS: SIGKILL every process in network namespace NS until none is left.
kill_ns() {
  local pids
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    pids=$(ip netns pids "$1" 2>/dev/null | xargs) || true
    [[ -z "$pids" ]] && return 0
    # shellcheck disable=SC2086  # a list of pids
    kill -KILL $pids 2>/dev/null || true
    sleep 0.2
  done
  say "processes still in $1 after SIGKILL: $pids"
}

cmd_down() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk -v p="$ns_prefix-" 'index($1, p) == 1 { print $1 }'); do
    kill_ns "$ns"
    ip netns del "$ns"
  done
  rm -rf "$dir"
  [[ "${1:-}" == quiet ]] || say "down"
}

cmd_status() {
  local node
  [[ -f "$dir/nodes.list" ]] || { say "no virtual cluster is up"; return 1; }
  for node in $(nodes); do
    printf '%-8s %s  %s\n' "$node" "$(awk -v n="$node" '$2 == n { print $1 }' "$dir/hosts")" \
      "$(ip -n "$ns_prefix-$node" -br link show eth0 2>/dev/null | awk '{ print $2 }')"
  done
  if [[ $(scheduler) == slurm ]]; then enter node1 sinfo; else enter node1 pbsnodes -aS; fi
}

cmd_link() {
  local rate=${1:?usage: vcluster.sh link RATE|none} node
  [[ -f "$dir/nodes.list" ]] || die "no virtual cluster is up"
  [[ "$rate" == none ]] || rate_bytes "$rate" >/dev/null || die "RATE must look like 10gbit, 1gbit or 500mbit, got '$rate'"
  for node in $(nodes); do shape "$node" "$rate"; done
  echo "$rate" >"$dir/link.rate"  # a revived node's link is shaped the same
  say "links: ${rate}"
}

# shape NODE RATE: tc's token bucket on NODE's link (RATE none: unshaped).
shape() {
  local node=$1 rate=$2 bytes burst
  if [[ "$rate" == none ]]; then
    tc -n "$ns_prefix-$node" qdisc del dev eth0 root 2>/dev/null || true
    return 0
  fi
  bytes=$(rate_bytes "$rate")
  # A bucket of 4 ms at the rate (at least 256 KiB: veth hands tc 64 KiB GSO segments); 50 ms of queue.
  burst=$((bytes / 250 > 262144 ? bytes / 250 : 262144))
  tc -n "$ns_prefix-$node" qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
}

# rate_bytes RATE: bytes per second of a tc rate written as <number><kbit|mbit|gbit>.
rate_bytes() {
  [[ "$1" =~ ^([0-9]+)(kbit|mbit|gbit)$ ]] || return 1
  local -A mult=([kbit]=125 [mbit]=125000 [gbit]=125000000)
  echo $((BASH_REMATCH[1] * mult[${BASH_REMATCH[2]}]))
}

cmd_cut_link() {
  local node=${1:?usage: vcluster.sh cut-link|restore-link NODE} state=${2:-down}
  node_pid "$node" >/dev/null
  ip -n "$switch_ns" link set "port${node#node}" "$state"
  say "$node: link $state"
}

cmd_signal_node() {
  local node=${1:?usage: vcluster.sh signal-node NODE SIGNAL PATTERN} sig=${2:?signal} pattern=${3:?pattern}
  local pid hit=0
  node_pid "$node" >/dev/null
  for pid in $(ip netns pids "$ns_prefix-$node"); do
    if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$pattern"; then
      kill -s "$sig" "$pid" 2>/dev/null && hit=$((hit + 1))
    fi
  done
  say "$node: SIG$sig sent to $hit process(es) matching '$pattern'"
  ((hit > 0))
}

cmd_kill_node() {
  local node=${1:?usage: vcluster.sh kill-node NODE}
  node_pid "$node" >/dev/null
  ip -n "$switch_ns" link set "port${node#node}" down  # the link first: peers see silence, not a reset
  kill_ns "$ns_prefix-$node"
  say "$node: link cut, every process killed"
}

# cmd_revive_node NODE: a failed node boots again: a fresh node in place of the dead one's namespaces, its link
# shaped as the others', its scheduler daemons started; returns once the scheduler has it back in service.
cmd_revive_node() {
  local node=${1:?usage: vcluster.sh revive-node NODE} i
  grep -qx "$node" "$dir/nodes.list" 2>/dev/null || die "no node '$node' in the virtual cluster (have: $(nodes | xargs))"
  [[ -z $(ip netns pids "$ns_prefix-$node" 2>/dev/null) ]] ||
    die "$node is up (kill-node $node first; restore-link undoes a cut-link)"
  i=${node#node}
  ip -n "$switch_ns" link del "port$i" 2>/dev/null || true
  ip netns del "$ns_prefix-$node" 2>/dev/null || true
  make_node "$i"
  shape "$node" "$(cat "$dir/link.rate" 2>/dev/null || echo none)"
  if [[ $(scheduler) == slurm ]]; then
    slurm_daemons "$node"
    # ReturnToService=2: a node that was DOWN for not responding is back in service once its slurmd registers
    wait_for "$node idle in sinfo" 60 node_in_service "$node"
  else
    pbs_habitat "$node"
    pbs_start "$node"
    wait_for "$node free in pbsnodes" 60 node_in_service "$node"
  fi
  say "$node: revived"
}

node_in_service() {
  if [[ $(scheduler) == slurm ]]; then
    [[ $(enter node1 sinfo -h -n "$1" -o %T) == idle ]]
  else
    enter node1 pbsnodes "$1" | grep -q '^ *state = free$'
  fi
}

main() {
  local cmd=${1:-}
  shift || true
  case "$cmd" in
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    status) cmd_status ;;
    link) cmd_link "$@" ;;
    kill-node) cmd_kill_node "$@" ;;
    revive-node) cmd_revive_node "$@" ;;
    cut-link) cmd_cut_link "${1:-}" down ;;
    restore-link) cmd_cut_link "${1:-}" up ;;
    signal-node) cmd_signal_node "$@" ;;
    exec)
      local node=node1
      if [[ "${1:-}" == -n ]]; then node=$2; shift 2; fi
      [[ $# -gt 0 ]] || die "usage: vcluster.sh exec [-n NODE] CMD..."
      enter "$node" "$@" ;;
    shell) enter "${1:-node1}" bash -i ;;
    _node-init) node_init "$@" ;;
    *) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//' >&2; [[ -z "$cmd" ]] || exit 2 ;;
  esac
}

main "$@"
