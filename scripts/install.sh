#!/usr/bin/env bash
# Install megatron-search into the current Python environment.
#   bash scripts/install.sh          # library + CLI
#   bash scripts/install.sh --dev    # plus test tools
#   MS_VLLM_CONTRACT=1 bash scripts/install.sh --dev   # plus vLLM 0.33.0's sources for its contract test
# On a CPU machine torch==2.13.0 (CPU build) is installed first so that nothing below pulls a
# multi-GB CUDA build; on a GPU machine install the torch build you want before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
# qwen-agent ships the real Qwen2/3 BPE ranks (qwen_agent/utils/qwen.tiktoken); its own runtime
# dependencies (openai, dashscope, ...) are not needed for that file, so it goes in without them.
if [ -n "$extras" ]; then
  "$PY" -m pip install --quiet --no-deps "qwen-agent>=0.0.30"
fi
"$PY" -m pip install --quiet -e ".${extras}"
# The contract tests check our SGLang client against sglang's own request types and rendezvous:
# sglang's pure-Python modules, pinned to the version the tests were written against, without its
# GPU dependencies; the installed torch and transformers are held where they are.
if [ -n "$extras" ]; then
  held=$(mktemp)
  "$PY" -m pip freeze | grep -iE '^(torch|transformers)==' > "$held"
  "$PY" -m pip install --quiet --no-deps "sglang==0.5.23"
  "$PY" -m pip install --quiet -c "$held" -r scripts/sglang-contract-requirements.txt
  rm -f "$held"
fi
# vLLM's contract test (tests/test_rollout_vllm_contract.py) needs vLLM 0.33.0's Python sources: its wheel is
# 336 MB (CUDA kernels), so they are fetched only on request (~157 MB kept, nothing installed into site-packages).
if [ -n "$extras" ] && [ "${MS_VLLM_CONTRACT:-0}" = "1" ]; then
  PYTHON="$PY" bash scripts/fetch_vllm_contract.sh
fi
