"""Prints the pins of a lock file that an install may apply here: every line of the lock, except the
packages that belong to the user's own stack and are installed already (their torch build, Triton, CUDA
libraries, SGLang, vLLM, Transformer Engine, fla), which keep the version they have.

    python scripts/lock_constraints.py requirements/lock.txt > constraints.txt
"""
from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

HELD = re.compile(r"^(torch|torchvision|torchaudio|triton|pytorch-triton.*|nvidia-.*|cuda-.*|sglang.*|vllm.*"
                  r"|transformer-engine.*|flash-linear-attention|fla-core|flash-attn.*)$")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(lock: str) -> None:
    installed = {normalise(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}
    for number, line in enumerate(Path(lock).read_text().splitlines(), 1):
        pin = line.split("#", 1)[0].strip()
        if not pin:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==\S+", pin)
        if not match:
            sys.exit(f"{lock}:{number}: not a 'name==version' pin: {line!r}")
        name = normalise(match[1])
        if HELD.match(name) and name in installed:
            continue  # the user's build stays
        print(pin)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
