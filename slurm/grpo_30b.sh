#!/usr/bin/env bash
#SBATCH --job-name=ms-grpo_30b
#SBATCH --nodes=1
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output=runs/slurm-%x-%j.out
# GRPO for Qwen3-30B-A3B-Instruct-2507: 1 node x 8 GPUs, SGLang colocated.
# Usage: sbatch slurm/grpo_30b.sh [key.sub=value ...]     (bash slurm/grpo_30b.sh --dry-run prints the plan)
MS_STAGE=grpo
MS_CONFIG=${MS_CONFIG:-configs/qwen3_30b_a3b_grpo.yaml}
MS_LIB=$(dirname "${BASH_SOURCE[0]}")/lib.sh  # sbatch runs a spooled copy of this script: then the submit dir's
[ -f "$MS_LIB" ] || MS_LIB=${MS_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/lib.sh
source "$MS_LIB"
ms_main "$@"
