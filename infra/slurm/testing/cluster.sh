#!/bin/bash
# A real Slurm cluster on this one host, for tests: munged, slurmctld and N slurmd ("nodes"
# n1..nN, Debian's build allows several slurmd per host), no systemd, no cgroups.
#
#   infra/slurm/testing/cluster.sh install        # apt-get install slurm-wlm munge (root)
#   infra/slurm/testing/cluster.sh up [N] [DIR]   # N nodes (default 2); config and state in DIR
#   infra/slurm/testing/cluster.sh down [DIR]
#
# Clients need SLURM_CONF=DIR/slurm.conf. Each node is declared with all CPUs and a share of
# the memory; jobs are scheduled by core (CR_Core), so steps may overlap (srun --overlap).
set -euo pipefail
cmd=${1:-}
case "$cmd" in
install)
    command -v sbatch >/dev/null && command -v slurmd >/dev/null && exit 0
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
    ;;
up)
    N=${2:-2}
    DIR=${3:-/tmp/primerl-slurm}
    HOST=$(hostname -s)
    # munge, without systemd: its run folder is not made for us
    if [ ! -s /etc/munge/munge.key ]; then mungekey --create --keyfile /etc/munge/munge.key; fi
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    mkdir -p /run/munge && chown munge:munge /run/munge && chmod 0755 /run/munge
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged
        for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    fi
    mkdir -p "$DIR"/state "$DIR"/log "$DIR"/spool
    MEM=$(( $(free -m | awk '/^Mem:/{print $7}') * 9 / 10 / N ))
    cat >"$DIR/slurm.conf" <<CONF
ClusterName=primerl-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
MinJobAge=3600
KillWait=5
InactiveLimit=0
MailProg=/bin/true
CONF
    for i in $(seq 1 "$N"); do
        echo "NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((17000 + i)) CPUs=$(nproc) RealMemory=$MEM State=UNKNOWN" >>"$DIR/slurm.conf"
    done
    echo "PartitionName=debug Nodes=n[1-$N] Default=YES MaxTime=INFINITE State=UP" >>"$DIR/slurm.conf"
    # slurmd 22.05 always loads a cgroup plugin; v1's needs no cgroup file system
    echo "CgroupPlugin=cgroup/v1" >"$DIR/cgroup.conf"
    export SLURM_CONF=$DIR/slurm.conf
    slurmctld
    for i in $(seq 1 "$N"); do mkdir -p "$DIR/spool/n$i"; slurmd -N "n$i"; done
    for _ in $(seq 120); do
        [ "$(sinfo -h -N -o %T 2>/dev/null | grep -cx idle || true)" = "$N" ] && exit 0
        sleep 0.5
    done
    echo "cluster.sh: the $N nodes are not idle after 60 s; see $DIR/log" >&2
    sinfo -N >&2 || true
    exit 1
    ;;
down)
    DIR=${2:-/tmp/primerl-slurm}
    export SLURM_CONF=$DIR/slurm.conf
    scontrol shutdown 2>/dev/null || true
    for _ in $(seq 20); do
        alive=0
        for f in "$DIR"/slurmctld.pid "$DIR"/slurmd.*.pid; do
            [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && alive=1
        done
        [ "$alive" = 0 ] && break
        sleep 0.5
    done
    for f in "$DIR"/slurmctld.pid "$DIR"/slurmd.*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; done
    [ -f /run/munge/munged.pid ] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null
    true
    ;;
*)
    echo "usage: cluster.sh install | up [N] [DIR] | down [DIR]" >&2
    exit 2
    ;;
esac
