#!/usr/bin/env bash
#SBATCH --job-name=ms-engine-probe
#SBATCH --nodes=2
#SBATCH --gpus-per-node=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:05:00
# The engine half of slurm/lib.sh on a real Slurm: plan a GRPO job's SGLang engines for this allocation
# and start them with ms_start_servers (one srun step each, as the sbatch scripts do). PYTHONPATH puts
# tests/slurm/probe first, so each step's SGLang main (`python -m megatron_search.rollout.sglang.serve ...`
# runs `sglang.launch_server`) records the node, the GPUs Slurm exposes to it, its argv and what it saw of
# the API key in $MS_PROBE_DIR, and exits. Overrides as for the scripts.
MS_STAGE=grpo
MS_CONFIG=${MS_CONFIG:-configs/tiny_grpo_slurm.yaml}
source "${MS_REPO:?}/slurm/lib.sh"
ms_parse_args "$@"
cd "$MS_REPO"
MS_NODELIST=$SLURM_JOB_NODELIST
eval "$(ms_launch_plan shell)"
MS_ENGINE_RESTARTS=0  # the probes exit on purpose: ms_serve_engine must not start them again
MS_LOG_DIR=${MS_LOG_DIR:?}
mkdir -p "$MS_LOG_DIR"
export PYTHONPATH=$MS_REPO/tests/slurm/probe${PYTHONPATH:+:$PYTHONPATH}
ms_engine_key
ms_start_servers
for pid in "${MS_SERVER_PIDS[@]}"; do wait "$pid"; done
ms_log "all $MS_ENGINE_COUNT engine processes exited"
