"""Multi-token prediction (MTP) around Megatron-Core's GPTModel: labels train it, no labels skip it.

Megatron's GPTModel with `mtp_num_layers` set runs the MTP block and adds its loss (through
`MTPLossAutoScaler`, weighted by `mtp_loss_scaling_factor`) whenever it runs on the last stage,
and megatron-core 0.16.1 then calls `labels.clone()` unconditionally: a logits-only forward
(labels=None: GRPO's policy step, the reward model, evaluation) fails with an AttributeError.

`MTPGPTModel` keeps Megatron's behaviour when labels are given (SFT: the MTP head trains on
token t+2 with the same loss mask as the main loss) and, without labels, skips the MTP block and
returns the main head's logits. That is how the RL loss leaves MTP out (a fixed choice of
train/grpo.py): the MTP weights are still built, loaded, exported and synced with the policy, and
the GRPO trainer freezes them (`freeze_mtp`).
"""
from __future__ import annotations

import copy

from megatron.core.models.gpt import GPTModel

MTP_PARAM_PREFIX = "mtp."


class MTPGPTModel(GPTModel):
    """GPTModel whose forward without labels skips the MTP block (main-head logits only)."""

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        if labels is not None or not self.config.mtp_num_layers:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        kwargs["mtp_in_postprocess"] = False
        # GPTModel._postprocess reads self.config.mtp_num_layers to attach the MTP loss; show it a
        # copy without MTP for this call only (the shared config other modules hold is not touched).
        config = self.config
        self.config = copy.copy(config)
        self.config.mtp_num_layers = None
        try:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        finally:
            self.config = config


def freeze_mtp(model_chunks) -> int:
    """Mark every MTP parameter as not trained (before the DDP wrap / optimizer); returns how many.

    Megatron's DDP and optimizer skip parameters without requires_grad, so the MTP weights keep
    their loaded values exactly (no weight decay, no optimizer state) while still being exported."""
    n = 0
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if name.startswith(MTP_PARAM_PREFIX):
                p.requires_grad_(False)
                n += 1
    return n
