#!/usr/bin/env bash
# A single-node SLURM cluster on this machine (munged, slurmctld, slurmd), for CI and for trying
# `ddp-launch launcher=slurm` without a real cluster.
#
#   slurm/local-cluster.sh start     # then: export SLURM_CONF=/tmp/ddp-launch-slurm/slurm.conf
#   slurm/local-cluster.sh status
#   slurm/local-cluster.sh stop      # cancels the cluster's jobs, stops the three daemons by their pid
#
# Needs root and Debian's packages (apt-get install -y slurmctld slurmd slurm-client munge). Everything it writes
# (config, munge key and socket, state, spool, logs, pid files) lives in one folder, DDP_LAUNCH_SLURM_DIR
# (default /tmp/ddp-launch-slurm), and the daemons use their own ports, so a system cluster or munged on the same
# machine is left alone. Nothing is installed as a service; stop leaves no process behind.
set -euo pipefail

DIR=${DDP_LAUNCH_SLURM_DIR:-/tmp/ddp-launch-slurm}
CTLD_PORT=${DDP_LAUNCH_SLURMCTLD_PORT:-16817}  # not 6817/6818: a system cluster may own those
SLURMD_PORT=${DDP_LAUNCH_SLURMD_PORT:-16818}
export SLURM_CONF=$DIR/slurm.conf
MUNGE_SOCKET=$DIR/munge/munge.socket

say() { echo "local-cluster: $*"; }
die() { echo "local-cluster: $*" >&2; exit 1; }

pid_of() {  # the pid in a pid file, if that process is alive
    local file=$DIR/$1.pid pid
    [[ -s $file ]] || return 1
    pid=$(<"$file")
    kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

node_state() { sinfo -h -N -o %T 2>/dev/null | head -n1; }

write_config() {
    local cpus mem_mb
    cpus=$(nproc)
    # 90% of the memory, so slurmd does not drain the node for reporting less than configured
    mem_mb=$(awk '/MemTotal/ { printf "%d", $2 / 1024 * 0.9 }' /proc/meminfo)
    cat >"$SLURM_CONF" <<EOF
# Written by slurm/local-cluster.sh; see that file and ../shared/notes/slurm-local.md for why each line is here.
ClusterName=ddplaunch
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# our munged's socket; short credentials: a requeued job may start again ~20 s after it ends instead of ~120 s
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
# containers: no cgroup process tracking or task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
JobRequeue=1
# finished jobs stay visible to scontrol for an hour (there is no slurmdbd, so no sacct)
MinJobAge=3600
KillWait=30
NodeName=localhost CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    if pid_of munged >/dev/null; then return; fi
    mkdir -p "$DIR/munge"
    chmod 0755 "$DIR/munge"  # clients of every user reach the socket through this folder
    if [[ ! -s $DIR/munge/munge.key ]]; then
        (umask 077 && head -c 1024 /dev/urandom >"$DIR/munge/munge.key")
    fi
    # --force: munged refuses a key and folders owned by root unless told; this cluster is root's own
    munged --force --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
}

start() {
    [[ $(id -u) == 0 ]] || die "needs root (slurmd runs jobs as their users)"
    for cmd in munged slurmctld slurmd sinfo; do
        command -v "$cmd" >/dev/null || die "$cmd is missing: apt-get install -y slurmctld slurmd slurm-client munge"
    done
    if pid_of slurmctld >/dev/null && pid_of slurmd >/dev/null && [[ $(node_state) == idle* ]]; then
        say "already running; export SLURM_CONF=$SLURM_CONF"
        return
    fi
    stop quiet
    mkdir -p "$DIR"/{state,spool,log}
    write_config
    start_munge
    # -c: a fresh cluster every start, no jobs recovered from a previous one
    slurmctld -c -f "$SLURM_CONF"
    slurmd -c -N localhost -f "$SLURM_CONF"
    for _ in $(seq 60); do
        [[ $(node_state) == idle* ]] && break
        sleep 1
    done
    [[ $(node_state) == idle* ]] || die "the node did not become idle in 60 s (state: $(node_state)); logs in $DIR/log"
    say "running ($(nproc) CPUs, partition debug); export SLURM_CONF=$SLURM_CONF"
}

stop() {
    local quiet=${1:-} name pid
    if pid_of slurmctld >/dev/null; then
        # jobs first: a job's processes belong to slurmstepd, which outlives slurmd
        scancel --full --quiet --partition=debug 2>/dev/null || true
        for _ in $(seq 30); do
            [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break
            sleep 1
        done
    fi
    for name in slurmd slurmctld munged; do
        pid=$(pid_of "$name") || continue
        kill "$pid"
        for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid"; fi
        rm -f "$DIR/$name.pid"
        [[ -n $quiet ]] || say "stopped $name ($pid)"
    done
}

status() {
    local name
    for name in munged slurmctld slurmd; do
        if pid=$(pid_of "$name"); then echo "$name running ($pid)"; else echo "$name stopped"; fi
    done
    if pid_of slurmctld >/dev/null; then sinfo; squeue; fi
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) die "usage: $0 start|stop|status" ;;
esac
