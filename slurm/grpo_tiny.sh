#!/usr/bin/env bash
#SBATCH --job-name=ms-grpo_tiny
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@60
#SBATCH --output=runs/slurm-%x-%j.out
#SBATCH --open-mode=append
# Tiny-config GRPO on 2 nodes x 1 CPU rank (EP=2), rollouts on the first rank's in-process CPU
# engine: the same library and launch path as the big scripts, small enough for CI's local Slurm.
# Usage (from the repo root; the data, index, tokenizer and reward model as overrides):
#   sbatch slurm/grpo_tiny.sh model.tokenizer=T data.qa_path=QA.jsonl 'data.mix={qa: 1.0}' search.index_dir=IDX rm.load=RM
MS_STAGE=grpo
MS_CONFIG=${MS_CONFIG:-configs/tiny_grpo_slurm.yaml}
MS_LIB=$(dirname "${BASH_SOURCE[0]}")/lib.sh  # sbatch runs a spooled copy of this script: then the submit dir's
[ -f "$MS_LIB" ] || MS_LIB=${MS_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/lib.sh
source "$MS_LIB"
ms_main "$@"
