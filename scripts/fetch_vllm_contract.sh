#!/usr/bin/env bash
# vLLM 0.33.0's Python sources for tests/test_rollout_vllm_contract.py, without installing vLLM.
#   bash scripts/fetch_vllm_contract.sh            # into .cache/vllm-contract-0.33.0 (or $MS_VLLM_CONTRACT_PATH)
# The wheel is 336 MB (its CUDA kernels); only its Python files are kept (the compiled .so files, flash-attn and
# the vllm-rs binary are dropped: ~120 MB left), plus the pure/small modules in requirements/vllm-contract.lock.txt
# (~40 MB), all with --no-deps so the installed torch and transformers are not touched. Opt-in from
# scripts/install.sh (MS_VLLM_CONTRACT=1) because of the download.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${MS_VLLM_CONTRACT_PATH:-.cache/vllm-contract-0.33.0}
REQS=requirements/vllm-contract.lock.txt
STAMP=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ -f "$DEST/vllm/_version.py" ] && grep -q "0.33.0" "$DEST/vllm/_version.py" \
   && [ "$(cat "$DEST/.requirements.sha256" 2>/dev/null)" = "$STAMP" ]; then
  echo "vLLM 0.33.0 contract sources already in $DEST"; exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download --quiet --no-deps --only-binary :all: "vllm==0.33.0" -d "$tmp"
mkdir -p "$DEST"
"$PY" - "$tmp" "$DEST" <<'PYEOF'
import pathlib, sys, zipfile
src, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(wheel,) = src.glob("vllm-0.33.0-*.whl")
with zipfile.ZipFile(wheel) as z:
    keep = [n for n in z.namelist() if not (n.endswith(".so") or n == "vllm/vllm-rs" or n.startswith("vllm/vllm_flash_attn/"))]
    z.extractall(dest, members=keep)
print(f"extracted {len(keep)} files of {wheel.name} into {dest}")
PYEOF
"$PY" -m pip install --quiet --no-deps --upgrade --target "$DEST" -r "$REQS"
echo "$STAMP" > "$DEST/.requirements.sha256"  # a changed requirements file fetches again
du -sh "$DEST"
