#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (localhost, as root) for the tests: munge, slurmctld and slurmd from
# Debian's slurm-wlm 22.05 (`apt-get install -y slurm-wlm munge`). No cgroups (containers rarely allow them):
# proctrack/linuxproc and task/none. The node claims --cpus CPUs whatever the hardware has, so a 2-core machine
# can hold a service job and a 2-task trainer job at once. Quick for tests: the schedulers look at pending jobs (a
# trainer waiting for its services to start, a requeued one) every second (bf_interval, sched_interval; SLURM's
# defaults 30 and 60 s), and a requeued job (a preempted trainer, exit 42) may start again after 10 s (cred_expire;
# default 120). Idempotent: a cluster that already answers is kept.
#
#   scripts/slurm/local_cluster.sh [--cpus N]      (default 8)
#   scripts/slurm/local_cluster.sh --stop
set -euo pipefail
cpus=8
die() { echo "local_cluster.sh: $*" >&2; exit 2; }
case "${1:-}" in
  --cpus) [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || die "--cpus: must be a positive integer"; cpus="$2" ;;
  --stop)  # the daemons this script started, by their pid files
    scontrol shutdown 2>/dev/null || true
    [[ -s /run/munge/munged.pid ]] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
    exit 0 ;;
  "") ;;
  *) die "unknown option $1 (--cpus N or --stop)" ;;
esac
[[ $EUID -eq 0 ]] || die "must run as root (the daemons and their spool folders)"
command -v slurmctld > /dev/null || die "slurmctld not found: apt-get install -y slurm-wlm munge"
if sinfo -h -o %T 2>/dev/null | grep -qx idle; then exit 0; fi

node="$(hostname -s)"
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge /var/log/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=drgrpo-local
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
SlurmdParameters=config_overrides
JobRequeue=1
ReturnToService=2
MpiDefault=none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
KillWait=30
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
[[ -s /etc/munge/munge.key ]] || { mkdir -p /etc/munge; dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
pgrep -x munged > /dev/null || runuser -u munge -- munged 2>/dev/null || munged --force
pgrep -x slurmctld > /dev/null || slurmctld
pgrep -x slurmd > /dev/null || slurmd
for _ in $(seq 60); do
  sinfo -h -o %T 2>/dev/null | grep -qx idle && exit 0
  scontrol update nodename="$node" state=resume 2>/dev/null || true
  sleep 1
done
die "the node did not come up idle in 60 s (see /var/log/slurm/slurmctld.log and slurmd.log)"
