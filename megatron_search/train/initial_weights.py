"""The weights a training stage starts from: checkpoint.load, else model.path (unless model.init=random).

A source is told apart by its files (config.model.weights_format): a training run's checkpoint (or its root),
of which only the model is read (optimizer, step and data position start fresh, as GRPO after SFT wants); a
`convert hf-to-mcore` output; or an HF safetensors directory. Every rank loads its own shards, in place, into
the chunks the trainer built, and then the optimizer refreshes its fp32 main copies of the parameters from them
(Megatron's reload_model_params): without that, bf16 training would step from the random init's main copies.
"""
from __future__ import annotations

from typing import Optional

from megatron_search.config.model import resolve_repo_path, weights_format
from megatron_search.distributed.init import host_group
from megatron_search.trainer.init_weights import load_model_weights
from megatron_search.weights.checkpoint import load_mcore_into
from megatron_search.weights.hf_source import HFTensorSource
from megatron_search.weights.load import load_hf_into_model


def load_initial_weights(trainer, cfg, groups) -> Optional[str]:
    """Every rank: load the stage's initial weights into `trainer` (collective); returns what was loaded, or None."""
    source = cfg.initial_weights_source()
    if source is None:
        return None
    path = resolve_repo_path(source)
    kind = weights_format(path)
    if kind == "run":
        note = f"run checkpoint {load_model_weights(trainer, path)}"
    elif kind == "mcore":
        load_mcore_into(cfg, trainer.model, path)
        note = f"Megatron checkpoint {path}"
    elif kind == "hf":
        # the ranks agree on errors and unused tensors over the host group: one rank's reads may take far
        # longer than another's (NCCL's 600 s watchdog would end the fast ones)
        load_hf_into_model(trainer.model, cfg.model.architecture, HFTensorSource.from_dir(path), groups,
                           world_group=host_group())
        note = f"HF checkpoint {path}"
    else:
        raise ValueError(f"{source}: holds no weights (no *.safetensors, no Megatron checkpoint: metadata.json, "
                         "trainer.json or latest)")
    trainer.optimizer.reload_model_params()  # the fp32 main parameters follow the loaded ones
    return note
