"""Trainer-level exact resume with Megatron's plain (non-distributed) optimizer: 4 steps straight vs
2 steps, save, a fresh Trainer loads, 2 more steps. Losses and grad norms of steps 3-4 must match
bit for bit (the SFT tests cover the distributed optimizer, the CPU default)."""
from __future__ import annotations

import pytest
import torch

from megatron_search.trainer.step import Batch


def _batch(i: int) -> Batch:
    g = torch.Generator().manual_seed(100 + i)
    t = torch.randint(0, 2048, (4, 17), generator=g)
    return Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous(), (torch.rand(4, 16, generator=g) > 0.3).float())


@pytest.mark.e2e
def test_plain_optimizer_resume_is_bitwise(tmp_path):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_search.config import load_config
    from megatron_search.distributed import init_distributed
    from megatron_search.trainer.core import Trainer

    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'ck'}", f"run.output_dir={tmp_path}", "optim.lr=1e-3",
                             "optim.lr_schedule=linear", "optim.warmup_steps=1", "parallel.distributed_optimizer=false"])

    def run(steps, load=None, save_after=None):
        ctx = init_distributed(cfg)
        try:
            tr = Trainer(cfg, ctx, total_steps=4)
            parts = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
            assert not any(isinstance(o, DistributedOptimizer) for o in parts)
            extra = tr.load(load) if load else {}
            out, path = [], None
            for i in steps:
                m = tr.step(_batch(i), micro_batch_size=2)
                out.append((m["loss"], m["grad_norm"], m["lr"]))
                if tr.iteration == save_after:
                    path = tr.save(extra={"next_batch": i + 1})
            return out, path, extra
        finally:
            ctx.teardown()

    straight, _, _ = run(range(4))
    first, ckpt, _ = run(range(2), save_after=2)
    second, _, extra = run(range(2, 4), load=ckpt)
    assert extra == {"next_batch": 2}
    as64 = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    assert torch.equal(as64(first + second), as64(straight))
    # warmup: step 0 at lr * 1/1; linear decay over steps 1..3 reaches min_lr=0 at the last step
    assert [r[2] for r in straight] == [1e-3, 1e-3, 5e-4, 0.0]


def test_context_parallel_training_is_refused_before_anything_is_built():
    """CP > 1 needs each rank to feed its chunks of the sequence, which the training step does not do:
    the Trainer refuses it with a clear error instead of training on wrong attention."""
    import pytest

    from megatron_search.config import config_from_dict
    from megatron_search.trainer.core import Trainer

    cfg = config_from_dict({"model": {"hf_config": "configs/models/tiny_qwen3_moe"}, "parallel": {"cp": 2}})
    with pytest.raises(ValueError, match=r"parallel\.cp: 2: context parallelism is not wired into training"):
        Trainer(cfg, ctx=None, total_steps=1)
