#!/usr/bin/env bash
# Install megatron-search into the current Python environment (make a venv first), through the lock.
#   bash scripts/install.sh          # library + CLI
#   bash scripts/install.sh --dev    # plus test tools and the SGLang contract copy in .cache/
#   MS_LOCK=none bash scripts/install.sh --dev   # the newest releases pyproject.toml allows instead of the lock
#   MS_VLLM_CONTRACT=1 bash scripts/install.sh --dev   # plus vLLM 0.33.0's sources for its contract test
# On a CPU machine torch==2.13.0 (CPU build) is installed first so that nothing below pulls a
# multi-GB CUDA build; on a GPU machine install the torch build you want before running this. Your torch,
# Triton, CUDA libraries, SGLang, vLLM and Transformer Engine are never replaced (scripts/lock_constraints.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOCK=${MS_LOCK:-requirements/lock.txt}
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
constraints=()
if [ "$LOCK" != none ]; then
  cons=$(mktemp)
  trap 'rm -f "$cons"' EXIT
  "$PY" scripts/lock_constraints.py "$LOCK" > "$cons"
  constraints=(-c "$cons")
fi
# qwen-agent ships the real Qwen2/3 BPE ranks (qwen_agent/utils/qwen.tiktoken); its own runtime
# dependencies (openai, dashscope, ...) are not needed for that file, so it goes in without them.
if [ -n "$extras" ]; then
  "$PY" -m pip install --quiet --no-deps "${constraints[@]}" "qwen-agent>=0.0.30"
fi
"$PY" -m pip install --quiet "${constraints[@]}" -e ".${extras}"
# The contract tests check our SGLang client against sglang's own request types and rendezvous: sglang's
# pure-Python modules go into .cache/, not into this environment (an SGLang you installed stays yours).
if [ -n "$extras" ]; then
  PYTHON="$PY" bash scripts/fetch_sglang_contract.sh
fi
# vLLM's contract test (tests/test_rollout_vllm_contract.py) needs vLLM 0.33.0's Python sources: its wheel is
# 336 MB (CUDA kernels), so they are fetched only on request (~157 MB kept, nothing installed into site-packages).
if [ -n "$extras" ] && [ "${MS_VLLM_CONTRACT:-0}" = "1" ]; then
  PYTHON="$PY" bash scripts/fetch_vllm_contract.sh
fi
