#!/bin/bash
# A one-node SLURM cluster on this machine (Debian's slurm-wlm and munge), for running shard-launch's slurm
# target against a real scheduler: `bash bench/slurm_local.sh start` installs what is missing, writes a
# slurm.conf into $SLURM_LOCAL (default /tmp/shard-slurm) and starts munged, slurmctld and slurmd;
# `... stop` stops them. Commands then need SLURM_CONF=$SLURM_LOCAL/slurm.conf (printed by start).
set -euo pipefail
DIR=${SLURM_LOCAL:-/tmp/shard-slurm}
case "${1:-start}" in
start)
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
  fi
  mkdir -p "$DIR"/{ctld,d,log}
  # munge authenticates slurm's messages; a key of its own if the package left none
  [ -s /etc/munge/munge.key ] || (dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null &&
                                   chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key)
  mkdir -p /run/munge && chown munge:munge /run/munge
  pgrep -x munged >/dev/null || runuser -u munge -- munged
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048 ))
  cat > "$DIR/slurm.conf" <<CONF
ClusterName=shardlocal
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/d
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
  export SLURM_CONF="$DIR/slurm.conf"
  pgrep -x slurmctld >/dev/null || slurmctld -f "$SLURM_CONF"
  pgrep -x slurmd >/dev/null || slurmd -f "$SLURM_CONF"
  for _ in $(seq 30); do
    sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix|alloc" && break
    sleep 1
  done
  sinfo -h -o "%P %D %T" && echo "export SLURM_CONF=$SLURM_CONF"
  ;;
stop)
  pkill -x slurmd || true
  pkill -x slurmctld || true
  ;;
*) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
