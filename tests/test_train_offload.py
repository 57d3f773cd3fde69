"""The colocated offload (train/offload.py) on a real Trainer after a step: parameters and optimizer state come
back bit for bit; the gradient buffers are freed without a copy and come back as zeros (the next step zeroes
them anyway); nothing stays resident while offloaded."""
from __future__ import annotations

import torch

from megatron_search.trainer.step import Batch


def test_offload_keeps_params_and_optimizer_and_drops_gradients(tmp_path):
    from megatron_search.config import load_config
    from megatron_search.distributed import init_distributed
    from megatron_search.train.offload import StateOffloader, _optimizer_tensors
    from megatron_search.trainer.core import Trainer

    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'ck'}", f"run.output_dir={tmp_path}", "optim.lr=1e-3"])
    ctx = init_distributed(cfg)
    try:
        tr = Trainer(cfg, ctx, total_steps=2)
        g = torch.Generator().manual_seed(1)
        t = torch.randint(0, 2048, (4, 17), generator=g)
        tr.step(Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous(), torch.ones(4, 16)), micro_batch_size=2)
        params = [p.detach().clone() for c in tr.ddp for p in c.parameters()]
        state = [x.detach().clone() for x in _optimizer_tensors(tr.optimizer)]
        grads = [p.main_grad for c in tr.ddp for p in c.parameters()]
        assert any(bool(gr.abs().sum() > 0) for gr in grads)  # the step left gradients behind
        off = StateOffloader(list(tr.ddp), tr.optimizer)
        storages = off._storages()
        nbytes = {k: sum(s.nbytes() for s in v) for k, v in storages.items()}
        assert all(nbytes[k] > 0 for k in ("params", "grads", "optimizer")), nbytes
        moved = off.offload()
        assert moved == nbytes["params"] + nbytes["optimizer"]  # the gradient buffers were not copied
        assert off.resident_bytes() == 0
        assert off.reload() == moved
        assert all(torch.equal(a, p.detach()) for a, p in zip(params, (p for c in tr.ddp for p in c.parameters())))
        assert all(torch.equal(a, b) for a, b in zip(state, _optimizer_tensors(tr.optimizer)))
        assert all(bool((gr == 0).all()) for gr in grads)
    finally:
        ctx.teardown()
