"""Start a run from another run's weights (checkpoint.load without checkpoint.resume).

Only the model is read from the Megatron distributed checkpoint: the optimizer, RNG, data position
and step counter start fresh, which is what GRPO after SFT wants.
"""
from __future__ import annotations

from pathlib import Path

from .checkpoint import MODEL_OPTIM, read_trainer_meta
from .checkpoint_dir import latest_checkpoint
from .sharded_state import load_model


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a checkpoint root (its latest complete checkpoint)."""
    p = Path(path)
    if (p / "trainer.json").is_file():
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise FileNotFoundError(f"checkpoint.load: no complete checkpoint at or under {p}")
    return latest


def load_model_weights(trainer, path: str | Path) -> Path:
    """Every rank: load this rank's model shards from the checkpoint at (or latest under) `path`."""
    ckpt = resolve_checkpoint(path)
    meta = read_trainer_meta(ckpt)
    if meta["num_chunks"] != len(trainer.model):
        raise ValueError(f"{ckpt}: {meta['num_chunks']} model chunk(s) saved, this run builds {len(trainer.model)}")
    load_model(trainer.model, ckpt / MODEL_OPTIM)
    return ckpt
