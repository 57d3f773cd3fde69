#!/usr/bin/env bash
#SBATCH --job-name=ms-grpo_122b
#SBATCH --nodes=16
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output=runs/slurm-%x-%j.out
# GRPO for Qwen3.5-122B-A10B: 16 nodes x 8 GPUs, SGLang colocated.
# Usage: sbatch slurm/grpo_122b.sh [key.sub=value ...]     (bash slurm/grpo_122b.sh --dry-run prints the plan)
MS_STAGE=grpo
MS_CONFIG=${MS_CONFIG:-configs/qwen3_5_122b_a10b_grpo.yaml}
MS_LIB=$(dirname "${BASH_SOURCE[0]}")/lib.sh  # sbatch runs a spooled copy of this script: then the submit dir's
[ -f "$MS_LIB" ] || MS_LIB=${MS_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/lib.sh
source "$MS_LIB"
ms_main "$@"
