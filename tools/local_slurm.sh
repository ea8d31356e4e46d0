#!/usr/bin/env bash
# A real single-machine Slurm for tests and CI: munge + slurmctld + two emulated nodes n1, n2 with 8 fake GPUs each.
#
#   tools/local_slurm.sh up     [--state DIR] [--accounting] [--port-base N]   # prints: export SLURM_CONF=...
#   tools/local_slurm.sh status [--state DIR]
#   tools/local_slurm.sh down   [--state DIR]
#
#   eval "$(tools/local_slurm.sh up)" && sbatch --wait slurm/dapo_tiny_cpu.sbatch
#
# Everything (configs, munge key and socket, spool, logs, pid files, MariaDB datadir) lives under one state directory
# (default /tmp/dapo-slurm-$UID). `up` installs Debian's slurmctld/slurmd/slurm-client/munge (+ slurmdbd and
# mariadb-server with --accounting, which sacct and nemo-run's status polling need) when they are missing and we are
# root, then starts only the daemons that are not already running: it is idempotent. `down` cancels the jobs of this
# private cluster and stops only the daemons it started, by their pid files. Ports: slurmctld N (default 6817),
# slurmdbd N+2, slurmd on n1/n2 N+10/N+11, MariaDB N+20. The nodes' GPUs are /dev/null symlinks: jobs see
# CUDA_VISIBLE_DEVICES=0..7 but no device. Recipe and pitfalls: shared/SLURM_LOCAL.md.
set -euo pipefail

ACTION=${1:-}
[[ $# -gt 0 ]] && shift
STATE=${DAPO_SLURM_STATE:-/tmp/dapo-slurm-$(id -u)}
ACCOUNTING=0
PORT_BASE=6817
while [[ $# -gt 0 ]]; do
    case $1 in
        --state) STATE=$2; shift 2 ;;
        --state=*) STATE=${1#*=}; shift ;;
        --accounting) ACCOUNTING=1; shift ;;
        --port-base) PORT_BASE=$2; shift 2 ;;
        --port-base=*) PORT_BASE=${1#*=}; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "local_slurm.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ $PORT_BASE =~ ^[0-9]+$ ]] || { echo "local_slurm.sh: --port-base must be a number, got '$PORT_BASE'" >&2; exit 2; }

NODES=(n1 n2)
GPUS_PER_NODE=8
CLUSTER=dapolocal
log() { echo "[local_slurm] $*" >&2; }
die() { echo "local_slurm.sh: error: $*" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------------------------------
# Installation

need_packages() {
    local pkgs=() cmd
    for cmd in slurmctld slurmd sbatch munged; do command -v "$cmd" >/dev/null || pkgs+=("$cmd"); done
    if [[ $ACCOUNTING == 1 ]]; then
        for cmd in slurmdbd mariadbd mariadb-install-db; do command -v "$cmd" >/dev/null || pkgs+=("$cmd"); done
    fi
    echo "${pkgs[*]:-}"
}

install_slurm() {
    local missing
    missing=$(need_packages)
    [[ -z $missing ]] && return 0
    if [[ $(id -u) != 0 ]]; then
        die "Slurm is not installed (missing: $missing) and installing it needs root. As root run:
  apt-get update && apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge$(
            [[ $ACCOUNTING == 1 ]] && echo ' slurmdbd mariadb-server')"
    fi
    command -v apt-get >/dev/null || die "Slurm is not installed (missing: $missing) and apt-get is not available"
    local pkgs=(slurmctld slurmd slurm-client munge)
    [[ $ACCOUNTING == 1 ]] && pkgs+=(slurmdbd mariadb-server)
    log "installing ${pkgs[*]} (apt-get)"
    apt-get update -q >&2 || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" >&2 \
        || die "apt-get install ${pkgs[*]} failed"
    missing=$(need_packages)
    [[ -z $missing ]] || die "still missing after apt-get install: $missing"
}

# ---------------------------------------------------------------------------------------------------------------------
# Pid files (the only way `down` finds what to stop)

pidfile() { echo "$STATE/run/$1.pid"; }

# alive NAME COMM: the pid in NAME's pid file runs and its command name is COMM (guards against recycled pids).
alive() {
    local f pid comm
    f=$(pidfile "$1")
    [[ -s $f ]] || return 1
    pid=$(tr -dc '0-9' <"$f")
    running "$pid" || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null || true)
    [[ $comm == "$2" ]]
}

# running PID: the process exists and is not a zombie (an exited daemon waits for PID 1 to reap it)
running() {
    local state
    state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)
    [[ -n $state && $state != Z ]]
}

stop() {  # stop NAME COMM
    local f pid i
    f=$(pidfile "$1")
    if alive "$1" "$2"; then
        pid=$(tr -dc '0-9' <"$f")
        log "stopping $1 (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do running "$pid" || break; sleep 0.1; done
        if running "$pid"; then
            log "$1 (pid $pid) ignored SIGTERM for 10 s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do running "$pid" || break; sleep 0.1; done
        fi
    fi
    rm -f "$f"
}

# name:comm of every daemon we may start, in start order
daemons() {
    echo munged:munged
    [[ -f $STATE/accounting ]] && { echo mariadbd:mariadbd; echo slurmdbd:slurmdbd; }
    echo slurmctld:slurmctld
    local n
    for n in "${NODES[@]}"; do echo "slurmd-$n:slurmd"; done
}

any_alive() {
    local d
    for d in $(daemons); do alive "${d%%:*}" "${d##*:}" && return 0; done
    return 1
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local secs=$1 what=$2 i
    shift 2
    for ((i = 0; i < secs * 5; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
    return 1
}

# ---------------------------------------------------------------------------------------------------------------------
# Configuration

write_configs() {
    local host nproc mem_mb n port i
    host=$(hostname)
    nproc=$(nproc --all)  # not plain nproc: it reports OMP_NUM_THREADS when that is set
    mem_mb=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
    ((mem_mb > 10000)) && mem_mb=10000
    mkdir -p "$STATE"/{run,log,ctld,spool,fakegpu}
    for ((i = 0; i < GPUS_PER_NODE; i++)); do ln -sfn /dev/null "$STATE/fakegpu/nvidia$i"; done

    local acct_lines="AccountingStorageType=accounting_storage/none"
    if [[ $ACCOUNTING == 1 ]]; then
        acct_lines="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$((PORT_BASE + 2))
AccountingStoragePass=$STATE/munge/munge.socket.2
JobCompType=jobcomp/none"
    fi
    # A random first job id per cluster: `dapo launch` takes its ports from the job id (megatron_dapo/launch/ports.py, block
    # id mod 55), so two local clusters on one machine that both counted from 1 gave their concurrent jobs the same
    # ports. Random starts make that 1 in 55 per pair of jobs that run at the same time (the tests use free ports
    # where they pin any).
    local first_job_id=$(((RANDOM << 15 | RANDOM) % 5000000 + 1000))
    cat >"$STATE/slurm.conf" <<EOF
# Written by tools/local_slurm.sh for state dir $STATE: two emulated nodes on this machine, 8 fake GPUs each.
ClusterName=$CLUSTER
FirstJobId=$first_job_id
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT_BASE
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again; Slurm's default (120 s) would make every
# requeue in the tests wait two minutes. Steps here start well within 20 s of their credential.
AuthInfo=socket=$STATE/munge/munge.socket.2,cred_expire=20
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
$acct_lines
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=300
InactiveLimit=0
MailProg=/bin/true
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/d-%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
GresTypes=gpu
EOF
    i=0
    for n in "${NODES[@]}"; do
        port=$((PORT_BASE + 10 + i))
        echo "NodeName=$n NodeHostname=$host NodeAddr=127.0.0.1 Port=$port CPUs=$nproc RealMemory=$mem_mb" \
            "Gres=gpu:$GPUS_PER_NODE State=UNKNOWN" >>"$STATE/slurm.conf"
        i=$((i + 1))
    done
    local nodelist
    nodelist=$(IFS=,; echo "${NODES[*]}")
    echo "PartitionName=debug Nodes=$nodelist Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" \
        >>"$STATE/slurm.conf"
    echo "NodeName=$nodelist Name=gpu File=$STATE/fakegpu/nvidia[0-$((GPUS_PER_NODE - 1))]" >"$STATE/gres.conf"

    if [[ $ACCOUNTING == 1 ]]; then
        touch "$STATE/accounting"
        (umask 077; cat >"$STATE/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket.2
DbdHost=localhost
DbdPort=$((PORT_BASE + 2))
SlurmUser=root
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((PORT_BASE + 20))
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
        )
    else
        rm -f "$STATE/accounting"
    fi
    echo "port_base=$PORT_BASE accounting=$ACCOUNTING" >"$STATE/options"
}

# ---------------------------------------------------------------------------------------------------------------------
# Daemons

start_munge() {
    alive munged munged && return 0
    local m=$STATE/munge
    mkdir -p "$m"
    [[ -s $m/munge.key ]] || mungekey --create --keyfile="$m/munge.key" >&2
    chown -R munge:munge "$m"
    chmod 0755 "$m"  # 0700 fails: "Socket is inaccessible"
    chmod 0600 "$m/munge.key"
    # munged runs as the munge user and writes its pid file itself; our run/ dir is root's, so it goes in munge/
    # first and is linked from run/.
    runuser -u munge -- munged --socket="$m/munge.socket.2" --key-file="$m/munge.key" \
        --pid-file="$m/munged.pid" --log-file="$m/munged.log" --seed-file="$m/munged.seed" \
        || die "munged did not start; see $m/munged.log"
    wait_for 10 munged test -s "$m/munged.pid" || die "munged wrote no pid file; see $m/munged.log"
    cp "$m/munged.pid" "$(pidfile munged)"
}

start_mariadb() {
    alive mariadbd mariadbd && return 0
    local d=$STATE/mysql
    mkdir -p "$d"
    if [[ ! -d $d/data/mysql ]]; then
        mariadb-install-db --no-defaults --datadir="$d/data" --user=root --auth-root-authentication-method=socket \
            --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1 \
            || die "mariadb-install-db failed; see $STATE/log/mariadb-install.log"
    fi
    setsid mariadbd --no-defaults --datadir="$d/data" --socket="$d/mysqld.sock" --port=$((PORT_BASE + 20)) \
        --bind-address=127.0.0.1 --pid-file="$(pidfile mariadbd)" --log-error="$STATE/log/mariadb.log" \
        --user=root --skip-name-resolve </dev/null >/dev/null 2>&1 &
    wait_for 60 mariadb mariadb --no-defaults -S "$d/mysqld.sock" -u root -e "select 1" \
        || die "MariaDB did not come up; see $STATE/log/mariadb.log"
    mariadb --no-defaults -S "$d/mysqld.sock" -u root -e "
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
        CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
        FLUSH PRIVILEGES;" || die "could not create the MariaDB user for slurmdbd"
}

start_slurmdbd() {
    alive slurmdbd slurmdbd && return 0
    slurmdbd || die "slurmdbd did not start; see $STATE/log/slurmdbd.log"
    wait_for 60 slurmdbd sacctmgr -n list cluster || die "slurmdbd does not answer; see $STATE/log/slurmdbd.log"
    if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >&2 || die "sacctmgr add cluster $CLUSTER failed"
    fi
}

start_slurmctld() {
    alive slurmctld slurmctld && return 0
    slurmctld -c || die "slurmctld did not start; see $STATE/log/slurmctld.log"
    wait_for 30 slurmctld scontrol ping || die "slurmctld does not answer; see $STATE/log/slurmctld.log"
}

start_slurmd() {
    local n=$1
    alive "slurmd-$n" slurmd && return 0
    mkdir -p "$STATE/spool/d-$n"
    slurmd -N "$n" || die "slurmd -N $n did not start; see $STATE/log/slurmd-$n.log"
}

nodes_idle() { [[ $(sinfo -h -o '%T %D' 2>/dev/null) == "idle ${#NODES[@]}" ]]; }

cmd_up() {
    install_slurm
    # munged must be started as the munge user and slurmd as root (it launches the jobs' tasks)
    [[ $(id -u) == 0 ]] || die "must run as root: munged is started as the munge user and slurmd as root"
    if [[ -f $STATE/options ]] && any_alive; then
        local want="port_base=$PORT_BASE accounting=$ACCOUNTING"
        [[ $(cat "$STATE/options") == "$want" ]] \
            || die "$STATE is running with '$(cat "$STATE/options")', asked for '$want': run down first"
    else
        write_configs
    fi
    chmod 0755 "$STATE"  # the munge user must reach $STATE/munge
    export SLURM_CONF=$STATE/slurm.conf
    start_munge
    if [[ $ACCOUNTING == 1 ]]; then
        start_mariadb
        start_slurmdbd
    fi
    start_slurmctld
    local n
    for n in "${NODES[@]}"; do start_slurmd "$n"; done
    if ! wait_for 60 "nodes idle" nodes_idle; then
        sinfo -R >&2 || true
        die "nodes are not 'idle ${#NODES[@]}' after 60 s (sinfo: $(sinfo -h -o '%T %D' | tr '\n' ' ')); logs in $STATE/log"
    fi
    log "up: ${#NODES[@]} nodes idle, $GPUS_PER_NODE fake GPUs each; state in $STATE"
    echo "export SLURM_CONF=$SLURM_CONF"
}

cmd_down() {
    export SLURM_CONF=$STATE/slurm.conf
    if [[ -f $SLURM_CONF ]] && alive slurmctld slurmctld; then
        local jobs i
        jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ' || true)
        if [[ -n ${jobs// /} ]]; then
            log "cancelling jobs of this cluster: $jobs"
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            for ((i = 0; i < 100; i++)); do [[ -z $(squeue -h -o %A 2>/dev/null) ]] && break; sleep 0.2; done
        fi
    fi
    local d names=() n
    for d in $(daemons); do names=("$d" "${names[@]}"); done  # stop in reverse start order
    for d in "${names[@]}"; do stop "${d%%:*}" "${d##*:}"; done
    # Sanity: nothing started from this state dir may survive
    for d in $(daemons); do
        n=${d%%:*}
        alive "$n" "${d##*:}" && die "$n is still running"
    done
    log "down: $STATE"
}

cmd_status() {
    export SLURM_CONF=$STATE/slurm.conf
    [[ -f $SLURM_CONF ]] || { echo "no local Slurm in $STATE"; return 3; }
    local d rc=0
    for d in $(daemons); do
        if alive "${d%%:*}" "${d##*:}"; then
            echo "${d%%:*}: running (pid $(tr -dc '0-9' <"$(pidfile "${d%%:*}")"))"
        else
            echo "${d%%:*}: stopped"; rc=3
        fi
    done
    echo "export SLURM_CONF=$SLURM_CONF"
    if alive slurmctld slurmctld; then sinfo; fi
    return $rc
}

case $ACTION in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) echo "usage: $0 up|down|status [--state DIR] [--accounting] [--port-base N]" >&2; exit 2 ;;
esac
