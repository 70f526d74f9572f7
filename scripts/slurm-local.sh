#!/usr/bin/env bash
# A two-node Slurm cluster on this one machine, for CI and for trying chatpipe's Slurm path on a laptop.
#
#   bash scripts/slurm-local.sh up       # start it (idempotent); prints the SLURM_CONF to export
#   bash scripts/slurm-local.sh status   # exit 0 when every daemon runs and both nodes are idle
#   bash scripts/slurm-local.sh env      # the `export SLURM_CONF=...` line
#   bash scripts/slurm-local.sh down     # stop every daemon it started, by pid (idempotent)
#
# Daemons: munged, MariaDB (accounting store), slurmdbd, slurmctld and two slurmd "nodes" n1 and n2
# (`slurmd -N`), all bound to 127.0.0.1 on ports picked free at `up`. Config, state, logs and pid files
# live under $CHATPIPE_SLURM_DIR (default /tmp/chatpipe-slurm); nothing under /etc is touched except an
# `127.0.0.1 n1 n2` line in /etc/hosts (the torchrun rendezvous host is the first node's name, so the
# names must resolve), added only when missing and removed again by `down`.
# Needs root (slurmd starts jobs as their user) and the Debian 12 packages
# munge slurmctld slurmd slurm-client slurmdbd mariadb-server.
set -euo pipefail

DIR="${CHATPIPE_SLURM_DIR:-/tmp/chatpipe-slurm}"
[[ $DIR == /?* ]] || { echo "slurm-local: CHATPIPE_SLURM_DIR must be an absolute path other than /, got '$DIR'" >&2; exit 2; }
CONF="$DIR/etc/slurm.conf"
CLUSTER=chatpipe
PARTITION=debug
NODES=(n1 n2)
HOSTS_MARK="# chatpipe-slurm"
MUNGE_SOCKET=/run/munge/munge.socket.2  # munge's default; see write_configs for why not under $DIR
DAEMONS=(munged mysqld slurmdbd slurmctld slurmd-n1 slurmd-n2)  # start order; `down` stops in reverse

die() { echo "slurm-local: cannot start the cluster: $*" >&2; exit 1; }
log() { echo "slurm-local: $*" >&2; }

pid_of() { # the live pid recorded for daemon $1, or nothing
    local f="$DIR/run/$1.pid" pid
    [[ -f $f ]] || return 1
    pid=$(<"$f")
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

start() { # start() NAME CMD...: run CMD in the foreground of its own session, record its pid
    local name=$1; shift
    setsid "$@" >"$DIR/log/$name.log" 2>&1 < /dev/null &
    echo $! >"$DIR/run/$name.pid"
}

wait_for() { # wait_for WHAT SECONDS CMD...: poll CMD until it succeeds
    local what=$1 secs=$2; shift 2
    local end=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < end)) || die "$what did not come up within ${secs}s; see $DIR/log/"
        local f
        for f in "$DIR"/run/*.pid; do  # a daemon that exited will not come back: say which and why
            pid_of "$(basename "$f" .pid)" >/dev/null ||
                die "$(basename "$f" .pid) exited; last lines of $DIR/log/$(basename "$f" .pid).log:
$(tail -5 "$DIR/log/$(basename "$f" .pid).log" 2>/dev/null)"
        done
        sleep 0.2
    done
}

free_ports() { # N free TCP ports on 127.0.0.1, held together while picked so they differ
    python3 - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

cluster_ready() {
    local states
    states=$(SLURM_CONF="$CONF" sinfo -h -N -p "$PARTITION" -o '%N %t' 2>/dev/null) || return 1
    [[ $(grep -cE '^n[12] (idle|mix|alloc)' <<<"$states") -eq 2 ]]
}

cmd_status() {
    local missing=()
    for d in "${DAEMONS[@]}"; do
        [[ $d == munged ]] && munge -n >/dev/null 2>&1 && continue  # ours or a system munged: either serves
        pid_of "$d" >/dev/null || missing+=("$d")
    done
    if ((${#missing[@]})); then
        echo "down (not running: ${missing[*]})"
        return 1
    fi
    if ! cluster_ready; then
        echo "daemons running but nodes not ready: $(SLURM_CONF="$CONF" sinfo -h -N -o '%N=%t' 2>&1 | tr '\n' ' ')"
        return 1
    fi
    echo "up: partition $PARTITION, nodes ${NODES[*]}; export SLURM_CONF=$CONF"
}

check_prereqs() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (slurmd starts each job as its owner; uid is $(id -u))"
    local missing=()
    for b in munged mariadbd mariadb-install-db mariadb slurmdbd slurmctld slurmd sbatch sacct sacctmgr python3; do
        command -v "$b" >/dev/null || missing+=("$b")
    done
    ((${#missing[@]} == 0)) || die "missing programs: ${missing[*]} (apt-get install munge slurmctld slurmd slurm-client slurmdbd mariadb-server)"
}

ensure_hosts() {
    if getent hosts n1 >/dev/null && getent hosts n2 >/dev/null; then return; fi
    echo "127.0.0.1 ${NODES[*]} $HOSTS_MARK" >>/etc/hosts || die "cannot add '127.0.0.1 n1 n2' to /etc/hosts"
    getent hosts n1 >/dev/null || die "n1 does not resolve even after adding it to /etc/hosts"
}

write_configs() {
    local ports mysql_port dbd_port ctld_port n1_port n2_port
    read -r mysql_port dbd_port ctld_port n1_port n2_port <<<"$(free_ports 5)"
    # munge at its default socket: Slurm 22.05's connections to slurmdbd ignore AuthInfo=socket=.
    local auth="AuthType=auth/munge"
    cat >"$CONF" <<EOF
# Written by scripts/slurm-local.sh: two slurmd "nodes" on one host.
ClusterName=$CLUSTER
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
$auth
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/nodes/%n
SlurmctldPidFile=$DIR/state/slurmctld.pid
SlurmdPidFile=$DIR/nodes/%n/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.daemon.log
SlurmdLogFile=$DIR/nodes/%n/slurmd.log
# No systemd or cgroup v1 here: plain /proc process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Both nodes claim the resources below, whatever the host has.
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
# Heterogeneous jobs (one component per node, as torchx submits them) are started by the backfill
# scheduler only; its default 30 s cycle would delay every multi-node stage by up to 30 s.
SchedulerParameters=bf_interval=1
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$dbd_port
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# A cancelled job's steps get SIGTERM, then SIGKILL this many seconds later.
KillWait=5
MinJobAge=60
MessageTimeout=20
SlurmdTimeout=120
InactiveLimit=0
NodeName=n1 NodeAddr=127.0.0.1 Port=$n1_port CPUs=2 RealMemory=8192 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=$n2_port CPUs=2 RealMemory=8192 State=UNKNOWN
PartitionName=$PARTITION Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$DIR/etc/slurmdbd.conf" <<EOF
$auth
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort=$dbd_port
SlurmUser=root
PidFile=$DIR/state/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.daemon.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$mysql_port
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$DIR/etc/slurmdbd.conf"  # slurmdbd refuses a config others can read (it has the DB password)
    echo "$mysql_port" >"$DIR/etc/mysql.port"
}

cmd_up() {
    if cmd_status >/dev/null 2>&1; then cmd_status; return 0; fi
    check_prereqs
    # A half-started cluster from an earlier run: stop what is left, start clean.
    cmd_down >/dev/null 2>&1 || true
    rm -rf "${DIR:?}"/{etc,run,log,state,munge,mysql,nodes}  # only what this script creates
    mkdir -p "$DIR"/{etc,run,log,state,munge,mysql,nodes/n1,nodes/n2}
    chmod 700 "$DIR/munge"
    ensure_hosts
    write_configs
    export SLURM_CONF="$CONF"

    if munge -n >/dev/null 2>&1; then
        log "using the munged already running at $MUNGE_SOCKET (not ours: \`down\` leaves it running)"
    else
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$DIR/munge/munge.key"
        mkdir -p "$(dirname "$MUNGE_SOCKET")"
        start munged munged --foreground --force --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/munge.key" \
            --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.daemon.log" --seed-file="$DIR/munge/seed"
        wait_for munged 20 munge -n
    fi

    mariadb-install-db --no-defaults --datadir="$DIR/mysql/data" --user=root --auth-root-authentication-method=socket \
        --skip-test-db >"$DIR/log/mysql-install.log" 2>&1 || die "mariadb-install-db failed; see $DIR/log/mysql-install.log"
    start mysqld mariadbd --no-defaults --datadir="$DIR/mysql/data" --user=root --bind-address=127.0.0.1 \
        --port="$(<"$DIR/etc/mysql.port")" --socket="$DIR/mysql/mysql.sock" --pid-file="$DIR/mysql/mysqld.pid" \
        --innodb-buffer-pool-size=32M --innodb-lock-wait-timeout=900 --skip-name-resolve
    wait_for MariaDB 60 mariadb --no-defaults --socket="$DIR/mysql/mysql.sock" -uroot -e 'select 1'
    mariadb --no-defaults --socket="$DIR/mysql/mysql.sock" -uroot -e "
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || die "cannot create the accounting DB user"

    start slurmdbd slurmdbd -D  # reads slurmdbd.conf beside $SLURM_CONF
    wait_for slurmdbd 60 sacctmgr -n list cluster
    sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster $CLUSTER failed"

    start slurmctld slurmctld -D -i -f "$CONF"
    wait_for slurmctld 60 scontrol ping
    for n in "${NODES[@]}"; do start "slurmd-$n" slurmd -D -N "$n" -f "$CONF"; done
    wait_for "nodes ${NODES[*]}" 60 cluster_ready
    cmd_status
}

stop_pid() { # stop_pid NAME: SIGTERM the recorded pid, SIGKILL after 15 s
    local pid
    pid=$(pid_of "$1") || { rm -f "$DIR/run/$1.pid"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { log "$1 ($pid) ignored SIGTERM; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; }
    rm -f "$DIR/run/$1.pid"
}

cmd_down() {
    if [[ -f $CONF ]] && pid_of slurmctld >/dev/null; then  # end running jobs first, so no worker outlives the nodes
        SLURM_CONF="$CONF" scancel --full --quiet --partition="$PARTITION" 2>/dev/null || true
    fi
    local i
    for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do stop_pid "${DAEMONS[i]}"; done
    if grep -q "$HOSTS_MARK" /etc/hosts 2>/dev/null; then
        # rewrite in place: /etc/hosts is often a bind mount that cannot be replaced by rename
        local kept
        kept=$(grep -v "$HOSTS_MARK" /etc/hosts)
        printf '%s\n' "$kept" >/etc/hosts
    fi
    echo "down"
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|status|env   (state in \$CHATPIPE_SLURM_DIR, default /tmp/chatpipe-slurm)" >&2; exit 2 ;;
esac
