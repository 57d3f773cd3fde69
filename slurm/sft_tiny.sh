#!/usr/bin/env bash
#SBATCH --job-name=ms-sft_tiny
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@60
#SBATCH --output=runs/slurm-%x-%j.out
#SBATCH --open-mode=append
# Tiny-config SFT on 2 nodes x 1 CPU rank (EP=2): the same library and launch path as the big
# scripts, small enough for CI's local two-node Slurm (tests/test_slurm_local.py).
# Usage (from the repo root): sbatch slurm/sft_tiny.sh model.tokenizer=DIR/tokenizer.json 'sft.datasets={DIR/sft.jsonl: 1.0}'
MS_STAGE=sft
MS_CONFIG=${MS_CONFIG:-configs/tiny_sft_slurm.yaml}
MS_LIB=$(dirname "${BASH_SOURCE[0]}")/lib.sh  # sbatch runs a spooled copy of this script: then the submit dir's
[ -f "$MS_LIB" ] || MS_LIB=${MS_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/lib.sh
source "$MS_LIB"
ms_main "$@"
