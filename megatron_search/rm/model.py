"""The preference reward model: the policy's Megatron GPTModel with a scalar value head (RECIPE 1).

The policy architecture is built exactly as for training (models/provider.py, same TP/PP/EP layout
and layer specs); on the last pipeline stage the LM head (`output_layer`, hidden -> vocab) is
replaced by a pass-through so the backbone returns its final-norm hidden states, and a replicated
`value_head` (hidden -> 1) maps them to one scalar per position. `RewardModel.forward` returns the
values [B, S] of every position; callers read the value at the last token of each scored text
(`values_at`), which under causal attention depends on the whole text and on nothing after it,
so right padding never changes a score.

Checkpoint keys are the policy's keys (the backbone's sharded state dict is used unprefixed) plus
`value_head.weight` / `value_head.bias`, so a policy checkpoint initialises the backbone directly.
With sequence parallelism the hidden states are gathered over TP before the head; the head is
then computed identically on every TP rank, so its backward splits (not reduce-scatters) the
gradient and the head's weight gradient is the same on every TP rank, like a LayerNorm's.
"""
from __future__ import annotations

from pathlib import Path

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import Tensor

from megatron_search.models.provider import build_model_chunks
from megatron_search.trainer.checkpoint import MODEL_OPTIM, read_trainer_meta
from megatron_search.trainer.init_weights import resolve_checkpoint
from megatron_search.trainer.sharded_state import load_model
from megatron_search.weights.hf_source import HFTensorSource
from megatron_search.weights.load import load_hf_into_model

VALUE_HEAD_PREFIX = "value_head."


class _HiddenPassthrough(torch.nn.Module):
    """Stands in for GPTModel.output_layer: returns the hidden states (gathered over SP) unchanged."""

    def __init__(self, sequence_parallel: bool, tp_group):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden: Tensor, weight=None, runtime_gather_output=None):  # noqa: ARG002 - output_layer API
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        return hidden, None


class ValueHead(torch.nn.Module):
    """hidden [.., H] -> values [..] (one linear map, replicated on every TP rank)."""

    def __init__(self, hidden_size: int, init_std: float, dtype: torch.dtype):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1, dtype=dtype)
        with torch.no_grad():
            self.linear.weight.normal_(0.0, init_std)
            self.linear.bias.zero_()

    def forward(self, hidden: Tensor) -> Tensor:
        return self.linear(hidden).squeeze(-1)


class RewardModel(MegatronModule):
    """GPTModel backbone + value head; forward(tokens, position_ids, mask, labels=None) -> values [B, S]."""

    def __init__(self, backbone):
        super().__init__(config=backbone.config)
        self.backbone = backbone
        self.pre_process, self.post_process = backbone.pre_process, backbone.post_process
        # attributes Megatron's schedules look up on the (wrapped) model
        self.model_type = backbone.model_type
        self.vp_stage = getattr(backbone, "vp_stage", None)
        # The value head is not tied to the embedding: no embedding-grad sync across PP stages
        # (finalize_model_grads reads the flag on the unwrapped model, i.e. on this module).
        backbone.share_embeddings_and_output_weights = False
        self.share_embeddings_and_output_weights = False
        self.value_head = None
        if backbone.post_process:
            tp_group = getattr(getattr(backbone, "pg_collection", None), "tp", None)
            backbone.output_layer = _HiddenPassthrough(bool(backbone.config.sequence_parallel), tp_group)
            self.value_head = ValueHead(backbone.config.hidden_size, backbone.config.init_method_std,
                                        backbone.config.params_dtype)

    def set_input_tensor(self, input_tensor) -> None:
        self.backbone.set_input_tensor(input_tensor)

    def forward(self, tokens, position_ids, attention_mask=None, labels=None):  # noqa: ARG002
        # labels are ignored: the preference loss is computed from the values by the caller.
        out = self.backbone(tokens, position_ids, attention_mask)
        if not self.post_process:
            return out  # hidden states for the next pipeline stage
        return self.value_head(out)  # GPTModel returns [B, S, H] -> values [B, S]

    def backbone_sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The policy's sharded state dict minus the LM head (the keys of a policy checkpoint)."""
        # LanguageModule.sharded_state_dict marks `output_layer.weight` on the last stage; the LM head
        # is gone, so present the backbone as a non-final stage while it lists its own tensors.
        self.backbone.post_process = False
        try:
            return self.backbone.sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            self.backbone.post_process = self.post_process

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        sd = self.backbone_sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.value_head is not None:
            local = self.value_head.linear.state_dict(keep_vars=True)
            sd.update(make_sharded_tensors_for_checkpoint(local, f"{prefix}{VALUE_HEAD_PREFIX}", {}, sharded_offsets))
        return sd

    def load_state_dict(self, state_dict, strict: bool = True):
        head = {k[len(VALUE_HEAD_PREFIX):]: v for k, v in state_dict.items() if k.startswith(VALUE_HEAD_PREFIX)}
        rest = {k: v for k, v in state_dict.items() if not k.startswith(VALUE_HEAD_PREFIX)}
        result = self.backbone.load_state_dict(rest, strict=strict)
        if self.value_head is not None:
            self.value_head.linear.load_state_dict(head, strict=strict)
        return result


def build_reward_model_chunks(cfg, groups) -> list:
    """One RewardModel per virtual pipeline stage of this rank in `groups` (model parallel state must exist)."""
    return [RewardModel(chunk) for chunk in build_model_chunks(cfg, groups)]


def values_at(values: Tensor, last_index: Tensor) -> Tensor:
    """values [B, S] -> the value at each row's last scored token, [B] in float32."""
    if last_index.shape != values.shape[:1]:
        raise ValueError(f"last_index: shape {tuple(last_index.shape)} does not match {values.shape[0]} rows")
    return values.float().gather(1, last_index.long().unsqueeze(1)).squeeze(1)


# ---------------------------------------------------------------------------------- initialisation
def _is_megatron_checkpoint(path: Path) -> bool:
    return (path / "trainer.json").is_file() or (path / "latest").is_file()


class _BackboneView:
    """A reward model seen as the policy it was built from: the policy checkpoint's keys, no head."""

    def __init__(self, rm: RewardModel):
        self.rm = rm

    def sharded_state_dict(self):
        return self.rm.backbone_sharded_state_dict()

    def load_state_dict(self, state_dict):
        # strict=False: the policy's LM head is the one tensor the reward model does not hold
        return self.rm.backbone.load_state_dict(state_dict, strict=False)


def init_from_policy(chunks: list, cfg, path: str | Path, groups) -> str:
    """Load the policy's weights into the backbones (the value head keeps its fresh init).

    `path`: a Megatron training checkpoint of the policy (trainer/checkpoint.py layout, or its root
    holding `latest`) or an HF safetensors directory. Returns a short description of what was loaded.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"rm.init_from: {path} does not exist")
    if _is_megatron_checkpoint(path):
        ckpt = resolve_checkpoint(path)
        read_trainer_meta(ckpt)
        load_model([_BackboneView(c) for c in chunks], ckpt / MODEL_OPTIM)
        return f"Megatron checkpoint {ckpt}"
    if any(path.glob("*.safetensors")):
        # strict=False: the HF lm_head is the one tensor the reward model does not use.
        load_hf_into_model([c.backbone for c in chunks], cfg.model.architecture, HFTensorSource.from_dir(path), groups,
                           strict=False)
        return f"HF checkpoint {path}"
    raise ValueError(f"rm.init_from: {path} is neither a Megatron checkpoint (trainer.json / latest) nor a "
                     "directory of *.safetensors")
