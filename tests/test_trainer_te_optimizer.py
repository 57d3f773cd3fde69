"""Save and resume with Megatron's distributed optimizer over Transformer Engine's FusedAdam and over torch's
AdamW, before and after the first step: a resumed run continues bit for bit as the straight run.

TE needs a GPU, so its optimizer is played by a stand-in written from TE's source
(transformer_engine/pytorch/optimizers/fused_adam.py, NVIDIA/TransformerEngine at d0067d0): the state keys
of `name_to_dtype_map` only (exp_avg, exp_avg_sq, master_param), "step" kept in the param group, state
created lazily at the first step by `initialize_state`, and `state_dict()` / `load_state_dict()` mapping every
state key through that map, so an unknown key ("step" per parameter, as torch's Adam keeps it) raises
KeyError as TE's does. Megatron is switched to its TE branch the way importing TE switches it (the module
flags of megatron.core.optimizer and its distrib_optimizer).
"""
from __future__ import annotations

from copy import deepcopy
from itertools import chain

import pytest
import torch

from megatron_search.trainer.step import Batch


class FusedAdamStandIn(torch.optim.Optimizer):
    """TE FusedAdam's state layout and state_dict contract (fp32 states, no master copy), torch math."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, bias_correction=True,
                 adam_w_mode=True, store_param_remainders=False, **unused):
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        self.adam_w_mode = adam_w_mode
        self.store_param_remainders = store_param_remainders
        self.name_to_dtype_map = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, "master_param": torch.float32}
        self.master_weights = False

    def _initialize_state(self, param, name, zero_buffer):
        data = torch.empty_like(param, dtype=self.name_to_dtype_map[name])  # KeyError for a name TE does not keep
        self.state[param][name] = data.zero_() if zero_buffer else data

    def initialize_state(self, param, store_param_remainders):
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)

    def get_unscaled_state(self, param, name):
        dtype = self.name_to_dtype_map[name]
        state = self.state[param][name]
        assert state.dtype == dtype
        return state

    def set_scaled_state(self, param, name, value):
        assert value.dtype == torch.float32
        if name not in self.state[param]:
            self._initialize_state(param, name, zero_buffer=False)
        self.state[param][name].copy_(value)

    def state_dict(self):
        sd = super().state_dict()
        ids = dict(zip(chain.from_iterable(g["params"] for g in deepcopy(sd["param_groups"])),
                       chain.from_iterable(g["params"] for g in self.param_groups)))
        for k, v in sd["state"].items():
            sd["state"][k] = {name: self.get_unscaled_state(ids[k], name) for name in v}
        return sd

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        ids = dict(zip(chain.from_iterable(g["params"] for g in deepcopy(state_dict["param_groups"])),
                       chain.from_iterable(g["params"] for g in self.param_groups)))
        for k, v in state_dict["state"].items():
            param = ids[k]
            self.state[param] = {}
            for name, value in v.items():
                if value is not None:
                    self.set_scaled_state(param, name, value.float())

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1  # advanced even for an empty group, as TE does
            beta1, beta2 = group["betas"]
            t = group["step"]
            c1, c2 = (1 - beta1 ** t, 1 - beta2 ** t) if group["bias_correction"] else (1.0, 1.0)
            for p in group["params"]:
                if len(self.state[p]) == 0:
                    self.initialize_state(p, False)
                if p.grad is None:
                    continue
                g, m, v = p.grad, self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]
                if not self.adam_w_mode and group["weight_decay"]:
                    g = g + group["weight_decay"] * p
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / c1) / ((v / c2).sqrt() + group["eps"])
                if self.adam_w_mode and group["weight_decay"]:
                    update = update + group["weight_decay"] * p
                p.add_(update, alpha=-group["lr"])


def test_the_stand_in_refuses_a_torch_style_step_like_te():
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdamStandIn([p])
    opt.state[p].update(exp_avg=torch.zeros(3), exp_avg_sq=torch.zeros(3), step=torch.zeros(()))
    with pytest.raises(KeyError, match="step"):
        opt.state_dict()


@pytest.fixture
def te_optimizer(monkeypatch):
    """Megatron builds FusedAdamStandIn where it would build TE's FusedAdam, and takes its TE branches."""
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.distrib_optimizer as dopt

    monkeypatch.setattr(mopt, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(mopt, "Adam", FusedAdamStandIn)
    monkeypatch.setattr(dopt, "Adam", FusedAdamStandIn)  # the class its constructor accepts
    monkeypatch.setattr(dopt, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(dopt, "USING_TE_OPTIMIZER", True)
    return FusedAdamStandIn


def _batch(i: int) -> Batch:
    g = torch.Generator().manual_seed(200 + i)
    t = torch.randint(0, 2048, (4, 17), generator=g)
    return Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous(), (torch.rand(4, 16, generator=g) > 0.3).float())


def _runs(tmp_path, inner_cls):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_search.config import load_config
    from megatron_search.distributed import init_distributed
    from megatron_search.trainer.core import Trainer

    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'ck'}", f"run.output_dir={tmp_path}", "optim.lr=1e-3",
                             "optim.weight_decay=0.1", "parallel.distributed_optimizer=true"])

    def run(steps, load=None, save_at=None):
        ctx = init_distributed(cfg)
        try:
            tr = Trainer(cfg, ctx, total_steps=4)
            parts = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
            assert parts and all(isinstance(o, DistributedOptimizer) and type(o.optimizer) is inner_cls
                                 for o in parts), [type(getattr(o, "optimizer", o)) for o in parts]
            if load:
                tr.load(load)
            out, path = [], None
            if save_at == tr.iteration:
                path = tr.save()
            for i in steps:
                m = tr.step(_batch(i), micro_batch_size=2)
                out.append((m["loss"], m["grad_norm"]))
                if save_at == tr.iteration:
                    path = tr.save()
            return out, path
        finally:
            ctx.teardown()

    return run


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["te_fused_adam", "torch_adamw"])
def test_save_and_resume_before_and_after_the_first_step(tmp_path, request, kind):
    inner = request.getfixturevalue("te_optimizer") if kind == "te_fused_adam" else torch.optim.AdamW
    run = _runs(tmp_path, inner)
    straight, _ = run(range(4))
    _, fresh = run([], save_at=0)  # a checkpoint before any step (GRPO: every group without signal)
    from_fresh, _ = run(range(4), load=fresh)
    first, mid = run(range(2), save_at=2)
    second, _ = run(range(2, 4), load=mid)
    as64 = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    assert torch.equal(as64(from_fresh), as64(straight))
    assert torch.equal(as64(first + second), as64(straight))
