"""Device-clean code, checked without a GPU: the device-side hot paths run on tensors of a device that is not
the host, with no values behind them.

Two such devices exist in a CPU build of torch. FakeTensorMode makes `cuda` tensors with no CUDA present and
raises FakeTensorDeviceMismatchError when a host tensor meets one; but views, `[:, None]` and autograd on them
need torch's CUDA device guard, which a CPU build raises or aborts in (checked), so it carries only the
cuda-specific checks here. The `meta` device runs every op, autograd included, with the same two properties: a
host tensor meeting a meta one raises ("Tensor on device cpu is not on the expected device meta"; 0-dim host
scalars excepted, as on a GPU), and reading a value (`.item()`, `bool()`, `nonzero()`) raises, where a GPU would
sync with the host. So this tier catches what a CPU-only suite cannot: a tensor built on the host inside a device
function, and host syncs in the per-micro-batch path. Covered: the policy losses (token and sequence IS, with
pi_old, forward and backward, value checks off as training runs them), the fused logprob + IS ratio's torch path
(forward and backward), routing replay's token order, and moving a packed rollout batch to the device. Not
covered (they run on the driver's host tensors): rewards, group advantages, the batch packing itself.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

DEV = torch.device("meta")


def test_the_harness_sees_a_host_tensor_meet_a_device_one_and_a_host_sync():
    x = torch.zeros(2, 3, device=DEV)
    with pytest.raises(RuntimeError, match="not on the expected device"):
        torch.where(x > 0, torch.ones(2, 3), x)
    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):
        bool((x > 0).any())
    with FakeTensorMode(), pytest.raises(FakeTensorDeviceMismatchError):
        y = torch.zeros(2, 3, device="cuda")
        torch.where(y > 0, torch.ones(2, 3), y)


def _loss_inputs(B=3, T=5):
    lp = torch.randn(B, T, device=DEV, requires_grad=True)
    return lp, torch.randn(B, T, device=DEV), torch.randn(B, device=DEV), torch.ones(B, T, device=DEV), \
        torch.randn(B, T, device=DEV)


@pytest.mark.parametrize("name", ["token_is", "sequence_is"])
@pytest.mark.parametrize("with_old", [False, True])
def test_policy_losses_stay_on_the_device_without_host_syncs(name, with_old):
    from megatron_search.rl.registry import get_policy_loss

    lp, infer, adv, mask, old = _loss_inputs()
    loss, metrics = get_policy_loss(name)(lp, infer, adv, mask, logp_old=old if with_old else None, is_cap=2.0,
                                         check_values=False)
    loss.backward()
    assert loss.device == DEV and lp.grad.device == DEV
    assert all(v.device == DEV for v in metrics.values()), {k: v.device for k, v in metrics.items()}


def test_the_loss_value_checks_are_the_host_syncs():
    """check_values=True (grpo.check_loss_values) reads values: on a device that is a host sync, by design."""
    from megatron_search.rl.losses import token_is_loss

    lp, infer, adv, mask, _ = _loss_inputs()
    with pytest.raises(RuntimeError, match="cannot be called on meta tensors|meta"):
        token_is_loss(lp, infer, adv, mask, check_values=True)


def test_fused_logprob_torch_path_stays_on_the_device():
    from megatron_search.kernels import token_logprobs

    logits = torch.randn(2, 4, 32, device=DEV, requires_grad=True)
    targets = torch.randint(0, 32, (2, 4), device=DEV)
    out = token_logprobs(logits, targets, logp_infer=torch.randn(2, 4, device=DEV),
                         mask=torch.ones(2, 4, device=DEV, dtype=torch.bool), with_entropy=True, backend="torch",
                         check_values=False)  # as training calls it (grpo.check_loss_values off)
    (out.logp.sum() + out.entropy.sum()).backward()
    assert out.logp.device == out.ratio.device == logits.grad.device == DEV
    assert all(v.device == DEV for v in out.stats.values())


def test_routing_replay_token_order_on_the_device():
    from megatron_search.models.routing_replay import _local_tokens

    experts = torch.full((2, 6, 4), -1, dtype=torch.int32, device=DEV)  # padding rows get filler experts
    for sp in (False, True):
        assert _local_tokens(experts, 1, 2, sp).device == DEV
    with FakeTensorMode():  # and on (fake) CUDA, where a host-built filler used to meet the engine's experts
        assert _local_tokens(torch.zeros(2, 6, 4, dtype=torch.int64, device="cuda"), 0, 1, False).device.type == "cuda"


def test_a_packed_rollout_batch_moves_whole_to_the_device():
    from megatron_search.train.rollout_batch import RolloutBatch

    host = RolloutBatch(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64),
                        torch.zeros(2, 4), torch.ones(2, 4), torch.zeros(2),
                        torch.full((2, 4, 3, 2), -1, dtype=torch.int32), (1, 3, 5))
    dev = host.to(DEV)
    assert all(t.device == DEV for t in (dev.tokens_BS, dev.targets_BS, dev.logp_infer_BS, dev.mask_BS,
                                         dev.advantages_B, dev.routed_experts_BSLK))
    assert dev.expert_layers == (1, 3, 5)
