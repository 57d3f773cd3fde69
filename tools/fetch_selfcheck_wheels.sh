#!/usr/bin/env bash
# Download the wheels tools/gpu_selfcheck.py needs on a GPU host without network into .whl/ (git-ignored).
# The host (the H200 image) has torch 2.11 + CUDA 13, Triton 3.6, transformers 5.17, huggingface-hub,
# tokenizers, aiohttp, tensorboard, numpy, scipy, safetensors, tiktoken, psutil, PyYAML, tqdm, pyarrow 25, pandas 3,
# fsspec, xxhash; it lacks the packages below (datasets, dill and multiprocess for the data readers, seen missing
# on 2026-12-04). lingua (96 MB) stays behind: it is imported only where a rubric checks a reply's language. The versions are the ones this repo is tested with; transformers 5.24 replaces the image's
# 5.17, whose forward takes `past_key_values` and whose linear-attention cache differs from what the local
# engine was tested with. Two wheels are compiled (megatron-core, pydantic-core): they are fetched for
# CPython $PY_VERSION on manylinux x86_64 (default 3.12, the H200 image's Python).
#   bash tools/fetch_selfcheck_wheels.sh            # all of them, 19.4 MiB
#   bash tools/fetch_selfcheck_wheels.sh --train    # only what the train check needs, 18.0 MiB
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PY_VERSION=${PY_VERSION:-3.12}
DEST=${DEST:-.whl}
TRAIN=(megatron-core==0.16.1 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
       typing-inspection==0.4.2 typing-extensions==4.16.0 bm25s==0.3.16 transformers==5.24.0)
FLA=(fla-core==0.6.0 flash-linear-attention==0.6.0)  # the gdn and models checks
wheels=("${TRAIN[@]}")
[ "${1:-}" = "--train" ] || wheels+=("${FLA[@]}")
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" "${wheels[@]}"
ls -l "$DEST"/*.whl
du -ch "$DEST"/*.whl | tail -1
