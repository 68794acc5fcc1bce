#!/usr/bin/env bash
# A real two-node Slurm cluster on this machine, for the tests marked `real_slurm`
# (tests/real_slurm.py finds it): Debian's slurm-wlm and munge, one slurmctld and two
# `slurmd -N NAME` nodes, each node name in /etc/hosts (the JAX coordinator is the first
# node's name, as on a real cluster). No accounting (actx needs none), proctrack/linuxproc
# (a container has no cgroup delegation; docs/slurm.md says what a real cluster uses).
#
#   tests/slurm_cluster.sh install   apt-get the packages (root; a no-op when present)
#   tests/slurm_cluster.sh start     start munged, slurmctld, the nodes; wait until idle
#   tests/slurm_cluster.sh stop      stop them, remove the hosts entries and the state
#   tests/slurm_cluster.sh status    exit 0 when the cluster is up (both nodes answer)
#
# Everything it writes is under $ACTX_SLURM_DIR (default /tmp/actx-slurm); the cluster's
# config is $ACTX_SLURM_DIR/slurm.conf, and $ACTX_SLURM_DIR/ready exists while it runs.
# Exits non-zero, saying why on stderr, where it cannot (not root, no apt, a daemon that
# does not come up); the tests then skip, naming the reason kept in $ACTX_SLURM_DIR/why.
set -uo pipefail

DIR=${ACTX_SLURM_DIR:-/tmp/actx-slurm}
NODES=(actx-n1 actx-n2)
CTLD_PORT=${ACTX_SLURM_PORT:-16817}
MARK="# actx-slurm test cluster"

fail() {
    mkdir -p "$DIR" 2>/dev/null && echo "$*" > "$DIR/why"
    echo "slurm_cluster: $*" >&2
    exit 1
}

install() {
    [ "$(id -u)" = 0 ] || fail "not root: cannot install slurm-wlm and munge"
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v munged >/dev/null && command -v sbatch >/dev/null; then
        return 0
    fi
    command -v apt-get >/dev/null || fail "no apt-get: cannot install slurm-wlm and munge"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        slurm-wlm munge; } >"${DIR}.apt.log" 2>&1 \
        || fail "apt-get install slurm-wlm munge failed (see ${DIR}.apt.log)"
}

write_conf() {
    local cpus mem
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 4 ))
    cat > "$DIR/slurm.conf" <<EOF
ClusterName=actx-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
# KillWait: Slurm's default (30 s) between a cancel's SIGTERM and its SIGKILL: a worker
# stops at its next step boundary, which on a 2-core machine under the suite's load can
# take more than a few seconds.
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=30
MinJobAge=30
NodeName=${NODES[0]} NodeAddr=127.0.0.1 Port=16818 CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=${NODES[1]} NodeAddr=127.0.0.1 Port=16819 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=actx Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
    [ "$(id -u)" = 0 ] || fail "not root: cannot start slurmctld and slurmd"
    for bin in munged slurmctld slurmd sbatch; do
        command -v $bin >/dev/null || fail "no $bin: run '$0 install' first (needs apt)"
    done
    stop >/dev/null 2>&1
    mkdir -p "$DIR/ctld" "$DIR/munge"
    rm -f "$DIR/why"
    for n in "${NODES[@]}"; do mkdir -p "$DIR/spool/$n"; done
    write_conf
    export SLURM_CONF=$DIR/slurm.conf
    # The node names resolve (to this machine), as they must between a real cluster's nodes.
    { grep -v "$MARK" /etc/hosts; echo "127.0.0.1 ${NODES[*]} $MARK"; } > "$DIR/hosts" \
        && cat "$DIR/hosts" > /etc/hosts || fail "cannot write /etc/hosts"
    # munged of its own (socket and pid under $DIR), with the key the package made.
    [ -r /etc/munge/munge.key ] || fail "no /etc/munge/munge.key (munge not installed?)"
    chown munge:munge "$DIR/munge" 2>/dev/null
    local sock=$DIR/munge/munge.socket.2
    munged --force --socket="$sock" --pid-file="$DIR/munge/munged.pid" \
        --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" \
        >/dev/null 2>&1 || fail "munged did not start (see $DIR/munge/munged.log)"
    # Slurm's commands and daemons find munged's socket at its default path only.
    mkdir -p /run/munge
    if [ ! -S /run/munge/munge.socket.2 ] || [ -L /run/munge/munge.socket.2 ]; then
        ln -sf "$sock" /run/munge/munge.socket.2
    fi
    slurmctld -f "$SLURM_CONF" >/dev/null 2>&1 \
        || fail "slurmctld did not start (see $DIR/slurmctld.log)"
    for n in "${NODES[@]}"; do
        slurmd -f "$SLURM_CONF" -N "$n" >/dev/null 2>&1 \
            || fail "slurmd -N $n did not start (see $DIR/slurmd-$n.log)"
    done
    local i state
    for i in $(seq 1 60); do
        state=$(sinfo -h -N -o "%N %t" 2>/dev/null | sort | tr '\n' ' ')
        if [ "$state" = "${NODES[0]} idle ${NODES[1]} idle " ]; then
            echo "$SLURM_CONF" > "$DIR/ready"
            echo "slurm_cluster: ${NODES[*]} idle (SLURM_CONF=$SLURM_CONF)"
            return 0
        fi
        sleep 0.5
    done
    fail "the nodes did not come up idle in 30 s (sinfo: ${state:-nothing}; see $DIR/*.log)"
}

stop() {
    rm -f "$DIR/ready"
    export SLURM_CONF=$DIR/slurm.conf
    if [ -f "$SLURM_CONF" ] && command -v scancel >/dev/null; then
        timeout 10 scancel --user=root >/dev/null 2>&1
    fi
    local pidfile
    for pidfile in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
        [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null
    done
    sleep 1
    for pidfile in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
        [ -f "$pidfile" ] && kill -9 "$(cat "$pidfile")" 2>/dev/null
        rm -f "$pidfile"
    done
    if [ -L /run/munge/munge.socket.2 ]; then rm -f /run/munge/munge.socket.2; fi
    if grep -q "$MARK" /etc/hosts 2>/dev/null; then
        grep -v "$MARK" /etc/hosts > "$DIR.hosts" && cat "$DIR.hosts" > /etc/hosts
        rm -f "$DIR.hosts"
    fi
    rm -rf "$DIR/ctld" "$DIR/spool"
    return 0
}

up() {
    [ -f "$DIR/ready" ] || return 1
    local state
    state=$(SLURM_CONF=$DIR/slurm.conf timeout 10 sinfo -h -N -o "%N" 2>/dev/null | sort -u \
        | tr '\n' ' ')
    [ "$state" = "${NODES[0]} ${NODES[1]} " ]
}

case "${1:-}" in
    status) up ;;
    install) mkdir -p "$DIR"; install ;;
    start) mkdir -p "$DIR"; start ;;
    stop) stop ;;
    *) echo "usage: $0 install|start|stop" >&2; exit 2 ;;
esac
