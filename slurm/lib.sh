# shellcheck shell=bash
# Shared library of the sbatch scripts. A script sets MS_STAGE and MS_CONFIG, then calls
# `ms_main "$@"`. Every knob can be set from the environment or the command line:
#   --dry-run              print the launch plan and commands, run nothing (works without Slurm)
#   --config FILE          config (default: the script's)
#   --nodes N              nodes for --dry-run outside Slurm (default: the config's cluster.nodes)
#   --tasks-per-node N     training ranks per node (default: cluster.gpus_per_node)
#   key.sub=value          config overrides, passed to training unchanged
# Environment: MS_PYTHON, MS_LOG_DIR, MS_MASTER_PORT, MS_HEALTH_TIMEOUT (s), MS_SRUN_ARGS, and the engines'
# API key in the variable rollout.api_key_env names (default MEGATRON_SEARCH_ENGINE_KEY; generated per job
# when unset; srun hands it to every engine and rank, so MS_SRUN_ARGS must not drop it with --export).
set -euo pipefail

MS_REPO=${MS_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
MS_PYTHON=${MS_PYTHON:-python3}
MS_HEALTH_TIMEOUT=${MS_HEALTH_TIMEOUT:-1800}
MS_SERVER_PIDS=()

ms_log() { echo "[megatron-search $(date -u +%H:%M:%S)] $*" >&2; }

ms_parse_args() {
  MS_DRY_RUN=${MS_DRY_RUN:-0}; MS_OVERRIDES=(); MS_DRY_NODES=${MS_DRY_NODES:-}
  while [ $# -gt 0 ]; do
    case "$1" in
      --dry-run) MS_DRY_RUN=1 ;;
      --config) MS_CONFIG=$2; shift ;;
      --nodes) MS_DRY_NODES=$2; shift ;;
      --tasks-per-node) MS_TASKS_PER_NODE_ARG=$2; shift ;;
      -h|--help) sed -n '2,12p' "${BASH_SOURCE[0]}"; exit 0 ;;
      *=*) MS_OVERRIDES+=("$1") ;;
      *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
  done
}

ms_launch_plan() {  # $1: text|shell
  local tpn=()
  [ -n "${MS_TASKS_PER_NODE_ARG:-}" ] && tpn=(--tasks-per-node "$MS_TASKS_PER_NODE_ARG")
  "$MS_PYTHON" -m megatron_search.cli launch-plan "$MS_STAGE" "$MS_CONFIG" "${MS_OVERRIDES[@]}" \
    --nodelist "$MS_NODELIST" "${tpn[@]}" --format "$1"
}

# Address other nodes use to reach NODE (Slurm's NodeAddr; the hostname on most clusters).
ms_node_addr() {
  scontrol show node "$1" -o 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p' | head -n1 | grep . || echo "$1"
}

ms_cleanup() {
  local rc=$?
  for pid in "${MS_SERVER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${MS_SERVER_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ ${#MS_SERVER_PIDS[@]} -gt 0 ] && ms_log "stopped ${#MS_SERVER_PIDS[@]} ${MS_ENGINE_KIND:-SGLang} server(s)"
  exit $rc
}

# Preemption: Slurm sends the signal (see --signal=B:USR1@...) to this batch shell; forward it to
# the training step, which saves a checkpoint and exits, then requeue the job.
ms_on_preempt() {
  ms_log "preemption signal: asking training to checkpoint, then requeueing job ${SLURM_JOB_ID:-}"
  [ -n "${MS_TRAIN_PID:-}" ] && kill -USR1 "$MS_TRAIN_PID" 2>/dev/null || true
  [ -n "${MS_TRAIN_PID:-}" ] && wait "$MS_TRAIN_PID" 2>/dev/null || true
  scontrol requeue "$SLURM_JOB_ID" || ms_log "scontrol requeue failed"
  exit 0
}

# A requeued job (Slurm sets SLURM_RESTART_COUNT > 0) continues from its latest checkpoint when
# one exists (the preemption path saved it); a first run, or one with nothing saved yet, starts fresh.
ms_resume_override() {
  [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] || return 0
  "$MS_PYTHON" - "$MS_CONFIG" "${MS_OVERRIDES[@]}" <<'PY'
import sys
from pathlib import Path
from megatron_search.config import load_config
from megatron_search.trainer.checkpoint_dir import latest_checkpoint
cfg = load_config(sys.argv[1], sys.argv[2:])
root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.output_dir) / "checkpoints"
if not cfg.checkpoint.resume and latest_checkpoint(root) is not None:
    print("checkpoint.resume=true")
PY
}

# The engines' API key: from $MS_ENGINE_KEY_ENV (the plan's rollout.api_key_env) or generated for this job,
# exported so every srun step inherits it. Never echoed, never an argument: python prints it into a variable.
ms_engine_key() {
  if [ -z "${!MS_ENGINE_KEY_ENV:-}" ]; then
    local key; key=$("$MS_PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32))')
    printf -v "$MS_ENGINE_KEY_ENV" '%s' "$key"
    ms_log "engine API key: generated for this job in \$$MS_ENGINE_KEY_ENV"
  else
    ms_log "engine API key: from \$$MS_ENGINE_KEY_ENV"
  fi
  export "${MS_ENGINE_KEY_ENV?}"
}

ms_start_servers() {
  local i
  mkdir -p "$MS_LOG_DIR/sglang"
  for ((i = 0; i < MS_ENGINE_COUNT; i++)); do
    ms_serve_engine "$i" &
    MS_SERVER_PIDS+=($!)
  done
  ms_log "started $MS_ENGINE_COUNT ${MS_ENGINE_KIND:-SGLang} server process(es); logs in $MS_LOG_DIR/sglang"
}

# Engine $1 of the plan, on its node, started again each time it exits (an OOM, an assert in the scheduler), at
# most MS_ENGINE_RESTARTS times (rollout.health.max_restarts), MS_ENGINE_RESTART_DELAY (10) s apart. The trainer
# attaches by URL: it waits for the engine at its next weight update and pushes it the current weights before
# it serves again (docs/ROLLOUT.md, "Failure model"). SIGTERM (ms_cleanup) stops the engine and the loop.
ms_serve_engine() {
  local i=$1 node_var="MS_ENGINE_NODE_$1" argv_var="MS_ENGINE_ARGV_$1[@]" restarts=0 rc pid
  local node=${!node_var}
  trap '[ -n "${pid:-}" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; exit 0' TERM
  while :; do
    srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap --kill-on-bad-exit=0 \
      "${!argv_var}" >>"$MS_LOG_DIR/sglang/engine_$i.$node.log" 2>&1 &
    pid=$!
    rc=0; wait "$pid" || rc=$?
    if [ "$restarts" -ge "${MS_ENGINE_RESTARTS:-0}" ]; then
      ms_log "engine $i on $node exited (code $rc); restarted $restarts time(s), not again"
      return 0
    fi
    restarts=$((restarts + 1))
    ms_log "engine $i on $node exited (code $rc); starting it again ($restarts of ${MS_ENGINE_RESTARTS:-0})"
    sleep "${MS_ENGINE_RESTART_DELAY:-10}"
  done
}

ms_wait_healthy() {
  local url deadline=$((SECONDS + MS_HEALTH_TIMEOUT))
  IFS=',' read -r -a urls <<<"$MS_ENGINE_URLS"
  for url in "${urls[@]}"; do
    until curl -sf "$url/health" >/dev/null 2>&1; do
      if [ $SECONDS -ge $deadline ]; then ms_log "engine $url not healthy after ${MS_HEALTH_TIMEOUT}s"; return 1; fi
      sleep 5
    done
    ms_log "engine $url healthy"
  done
}

ms_main() {
  ms_parse_args "$@"
  cd "$MS_REPO"
  if [ -n "${SLURM_JOB_NODELIST:-}" ] && [ "$MS_DRY_RUN" != 1 ]; then
    MS_NODELIST=$SLURM_JOB_NODELIST
  else
    local n=${MS_DRY_NODES:-$("$MS_PYTHON" -m megatron_search.cli config "$MS_CONFIG" "${MS_OVERRIDES[@]}" | sed -n 's/^  nodes: //p' | head -n1)}
    [ -n "$n" ] || { echo "megatron-search: $MS_CONFIG does not load with these overrides (the error above)" >&2; exit 2; }
    MS_NODELIST=${SLURM_JOB_NODELIST:-node[001-$(printf '%03d' "$n")]}
  fi
  if [ "$MS_DRY_RUN" = 1 ]; then
    echo "# dry run: node list $MS_NODELIST"
    ms_launch_plan text
    return 0
  fi
  local resume; resume=$(ms_resume_override)
  if [ -n "$resume" ]; then MS_OVERRIDES+=("$resume"); ms_log "restart ${SLURM_RESTART_COUNT}: resuming from the latest checkpoint"; fi
  eval "$(ms_launch_plan shell)"
  MS_LOG_DIR=${MS_LOG_DIR:-$MS_REPO/runs/slurm-${SLURM_JOB_ID:-local}}
  mkdir -p "$MS_LOG_DIR"
  export MASTER_ADDR; MASTER_ADDR=$(ms_node_addr "$MS_MASTER_NODE")
  export MASTER_PORT=${MS_MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
  trap ms_cleanup EXIT
  trap ms_on_preempt USR1 TERM
  ms_engine_key
  ms_log "job ${SLURM_JOB_ID:-?}: ${#MS_TRAIN_NODES[@]} training node(s) x $MS_TASKS_PER_NODE ranks, master $MASTER_ADDR:$MASTER_PORT"
  if [ "$MS_ENGINE_COUNT" -gt 0 ]; then
    ms_start_servers
    ms_wait_healthy
  fi
  local train_nodes; train_nodes=$(IFS=,; echo "${MS_TRAIN_NODES[*]}")
  # Training ranks only (the engines keep CUDA's default): Megatron's TP/SP communication overlap and its
  # grad-reduce ordering rely on one hardware queue per device (tensor_parallel/layers.py), as Megatron-LM's
  # launch scripts set. NCCL's fabric settings (NCCL_IB_*, NCCL_SOCKET_IFNAME) belong to the cluster: export them
  # before sbatch and srun passes them on.
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
  # shellcheck disable=SC2086
  srun --nodes="${#MS_TRAIN_NODES[@]}" --nodelist="$train_nodes" --ntasks-per-node="$MS_TASKS_PER_NODE" \
    --overlap --kill-on-bad-exit=1 ${MS_SRUN_ARGS:-} bash -c \
    'echo "[megatron-search] rank ${SLURM_PROCID} of ${SLURM_NTASKS} on node ${SLURMD_NODENAME:-$(hostname)}" >&2; exec "$@"' \
    ms-rank "${MS_TRAIN_ARGV[@]}" &
  MS_TRAIN_PID=$!
  wait "$MS_TRAIN_PID"
}
