#!/usr/bin/env bash
#SBATCH --job-name=ms-sft_397b
#SBATCH --nodes=16
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output=runs/slurm-%x-%j.out
# SFT warm-up for Qwen3.5-397B-A17B: 16 nodes x 8 GPUs.
# Usage: sbatch slurm/sft_397b.sh [key.sub=value ...]     (bash slurm/sft_397b.sh --dry-run prints the plan)
MS_STAGE=sft
MS_CONFIG=${MS_CONFIG:-configs/qwen3_5_397b_a17b_sft.yaml}
MS_LIB=$(dirname "${BASH_SOURCE[0]}")/lib.sh  # sbatch runs a spooled copy of this script: then the submit dir's
[ -f "$MS_LIB" ] || MS_LIB=${MS_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/lib.sh
source "$MS_LIB"
ms_main "$@"
