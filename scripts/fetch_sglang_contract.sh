#!/usr/bin/env bash
# sglang 0.5.23's pure-Python modules for tests/test_rollout_sglang_contract.py, without installing SGLang.
#   bash scripts/fetch_sglang_contract.sh     # into .cache/sglang-contract-0.5.23 (or $MS_SGLANG_CONTRACT_PATH)
# sglang and the packages its request types, serializer and rendezvous need beyond requirements/lock.txt go in
# with --no-deps (sglang's own requirements pin a CUDA torch and exact versions of what we already have), pinned
# by requirements/sglang-contract.lock.txt; only the contract check's child process puts the folder on its path.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${MS_SGLANG_CONTRACT_PATH:-.cache/sglang-contract-0.5.23}
REQS=requirements/sglang-contract.lock.txt
STAMP=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ "$(cat "$DEST/.requirements.sha256" 2>/dev/null)" = "$STAMP" ]; then
  echo "sglang 0.5.23 contract sources already in $DEST"; exit 0
fi
rm -rf "$DEST"
"$PY" -m pip install --quiet --no-deps --no-compile --target "$DEST" -r "$REQS"
echo "$STAMP" > "$DEST/.requirements.sha256"  # a changed lock fetches again
du -sh "$DEST"
