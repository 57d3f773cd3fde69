#!/usr/bin/env bash
#SBATCH --job-name=ms-sft_30b
#SBATCH --nodes=1
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output=runs/slurm-%x-%j.out
# SFT warm-up for Qwen3-30B-A3B-Instruct-2507: 1 node x 8 GPUs.
# Usage: sbatch slurm/sft_30b.sh [key.sub=value ...]     (bash slurm/sft_30b.sh --dry-run prints the plan)
MS_STAGE=sft
MS_CONFIG=${MS_CONFIG:-configs/qwen3_30b_a3b_sft.yaml}
MS_LIB=$(dirname "${BASH_SOURCE[0]}")/lib.sh  # sbatch runs a spooled copy of this script: then the submit dir's
[ -f "$MS_LIB" ] || MS_LIB=${MS_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/lib.sh
source "$MS_LIB"
ms_main "$@"
