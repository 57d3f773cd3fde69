#!/usr/bin/env bash
# A local Slurm cluster of two nodes on this one machine, for the Slurm tests.
#   tests/slurm/local_cluster.sh start DIR   -> prints `export SLURM_CONF=...` lines; daemons' PIDs in DIR
#   tests/slurm/local_cluster.sh stop DIR    -> stops exactly the daemons it started (by PID)
# Debian's slurmd supports several daemons on one host (-N NAME); a private munge socket and
# non-default ports keep it clear of any system Slurm. Installs the Debian packages when missing.
set -euo pipefail
cmd=${1:?start|stop}; dir=${2:?state directory}
mkdir -p "$dir"; dir=$(cd "$dir" && pwd)
base_port=${MS_SLURM_BASE_PORT:-16817}

stop() {
  for f in "$dir"/pids/*.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f"); kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true; rm -f "$f"
  done
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi

mkdir -p "$dir"/{pids,log,state,spool,munge,dev}
host=$(hostname -s)
# Each node declares 2 GPUs as generic resources (gres/gpu) backed by null devices: nothing uses them
# as devices (no cgroup device constraint), but Slurm allocates them and sets CUDA_VISIBLE_DEVICES for
# every step as on a GPU cluster, which is what the engine-placement test reads.
gpus=2
for n in n1 n2; do for ((g = 0; g < gpus; g++)); do
  [ -c "$dir/dev/${n}_gpu$g" ] || mknod "$dir/dev/${n}_gpu$g" c 1 3  # character devices, as slurmd requires (= /dev/null)
done; done
cat > "$dir/gres.conf" <<CONF
NodeName=n1 Name=gpu File=$dir/dev/n1_gpu[0-$((gpus - 1))]
NodeName=n2 Name=gpu File=$dir/dev/n2_gpu[0-$((gpus - 1))]
CONF
# Munge: private key, socket and pid; run as root with --force (this is a throwaway test cluster).
if [ ! -f "$dir/munge/munge.key" ]; then
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chmod 0400 "$dir/munge/munge.key"
fi
chmod 0700 "$dir/munge"
munged --force --socket="$dir/munge/munge.sock" --key-file="$dir/munge/munge.key" \
  --pid-file="$dir/pids/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"

cat > "$dir/slurm.conf" <<CONF
ClusterName=mslocal
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$base_port
SlurmdPort=$((base_port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.sock
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/pids/slurmctld.pid
SlurmdPidFile=$dir/pids/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait=10
InactiveLimit=0
MinJobAge=600
GresTypes=gpu
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((base_port + 2)) CPUs=2 RealMemory=8000 Gres=gpu:$gpus State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((base_port + 3)) CPUs=2 RealMemory=8000 Gres=gpu:$gpus State=UNKNOWN
PartitionName=local Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -i -f "$SLURM_CONF"
for n in n1 n2; do slurmd -N "$n" -f "$SLURM_CONF"; done
# Wait until both nodes are idle.
for _ in $(seq 60); do
  idle=$(sinfo -h -N -o "%N %T" 2>/dev/null | grep -c idle || true)
  [ "$idle" = 2 ] && break; sleep 1
done
if [ "${idle:-0}" != 2 ]; then
  echo "local Slurm did not come up; logs in $dir/log" >&2; sinfo -N >&2 || true; exit 1
fi
echo "export SLURM_CONF=$SLURM_CONF"
