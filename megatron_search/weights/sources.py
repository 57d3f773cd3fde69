"""What a conversion's source directory is, read from its files alone (no torch: `megatron-search convert` checks
it before anything heavy is imported or any process starts)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

EXTRA_DIR = "hf_extra"  # the HF config and side files a Megatron checkpoint carries (weights/checkpoint.py)


def run_checkpoint_step(src: Path) -> Optional[Path]:
    """The step directory of a training run's checkpoint at `src` (a step directory with trainer.json, or a
    checkpoint root with its `latest` pointer: trainer/checkpoint_dir.py's layout), else None."""
    if (src / "trainer.json").is_file():
        return src
    pointer = src / "latest"
    if pointer.is_file() and (src / pointer.read_text().strip() / "trainer.json").is_file():
        return src / pointer.read_text().strip()
    steps = sorted(p for p in src.glob("step_*") if (p / "trainer.json").is_file() and ".tmp-" not in p.name)
    return steps[-1] if steps else None  # step_%08d: the newest complete one


def source_problem(direction: str, src: str | Path, hf_config: Optional[str] = None) -> Optional[str]:
    """Why `src` cannot be converted in `direction` (hf_to_mcore | mcore_to_hf), in one line; None: it can."""
    p = Path(src)
    if not p.exists():
        return f"--src {src}: no such directory"
    if not p.is_dir():
        return f"--src {src}: not a directory"
    if direction == "hf_to_mcore":
        if not any(p.glob("*.safetensors")):
            return f"--src {src}: no *.safetensors here (an HF checkpoint directory holds model*.safetensors and " \
                   "config.json)"
        if hf_config is None and not (p / "config.json").is_file():
            return f"--src {src}: no config.json (pass --hf-config)"
        return None
    if run_checkpoint_step(p) is not None:
        return None
    if not (p / "metadata.json").is_file():
        return f"--src {src}: neither a Megatron distributed checkpoint (metadata.json) nor a training run's " \
               "checkpoint (step_*/trainer.json)"
    if hf_config is None and not (p / EXTRA_DIR / "config.json").is_file():
        return f"--src {src}: no {EXTRA_DIR}/config.json to name the architecture (pass --hf-config)"
    return None
