#!/usr/bin/env python
"""Seconds per GRPO step, split by phase, for the demo config on this machine (CPU).

Builds the demo's world/data/tokenizer and a briefly trained reward model in a scratch directory
(the demo's own stages), runs `megatron-search grpo` for a few steps from the random-init policy,
and prints the mean of each phase over the steps after the first (the first pays for process
warm-up and the reference answers):

    python tools/bench_grpo_step.py [--steps 4] [--out /tmp/bench_grpo] [key=value ...]

`--micro-batches` measures only the policy update (train/microbatches.py) on the embedded tiny model, one
process: rows of rollout-like lengths (seeded log-normal, the longest at --width) trained as one padded batch,
cut per micro-batch (grpo.trim_padding), and under a token budget; it prints the positions each computes
against padding every row to the batch's longest, and seconds per update against the padded run:

    python tools/bench_grpo_step.py --micro-batches [--rows 32] [--width 256] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

PHASES = ["time/rollout_s", "time/reference_s", "time/reward_s", "time/train_s", "time/weight_sync_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--micro-batches", action="store_true", help="only the policy update's micro-batching")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.micro_batches:
        return bench_micro_batches(args.rows, args.width, args.repeats, args.overrides)

    from megatron_search.demo.pipeline import DEMO_CONFIG, Demo, _cli, _scalars

    out = Path(args.out or tempfile.mkdtemp(prefix="bench_grpo_"))
    repo = Path(__file__).resolve().parents[1]
    demo = Demo(out, str(repo / DEMO_CONFIG), list(args.overrides))
    paths = demo.paths()
    demo.stage("data", paths["qa"], demo.build_data)
    demo.stage("reward model", paths["rm"] / "checkpoints" / "latest", lambda: _cli(
        ["rm", "train", demo.config, *demo.common(), f"run.output_dir={paths['rm']}", "rm.steps=5", "--demo", "64"],
        demo.log))
    run_dir = out / "grpo_bench"
    _cli(["grpo", demo.config, *demo.common(), f"run.output_dir={run_dir}", f"data.qa_path={paths['qa']}",
          f"rm.load={paths['rm'] / 'checkpoints'}", f"grpo.steps={args.steps}", "logging.progress_bars=false"],
         demo.log)
    tb = run_dir / "tensorboard"
    rows = []
    for tag in PHASES:
        values = _scalars(tb, tag)[1:] or _scalars(tb, tag)
        rows.append((tag.split("/")[1].removesuffix("_s"), statistics.mean(values) if values else float("nan")))
    total = sum(v for _, v in rows)
    print(f"\nGRPO step phases (mean over steps 2..{args.steps}; "
          f"{demo.overrides or 'configs/demo.yaml'}), seconds:")
    for name, v in rows:
        print(f"  {name:<14} {v:8.2f}   {100 * v / total:5.1f}%")
    print(f"  {'total':<14} {total:8.2f}")
    rps = _scalars(tb, "perf/rollouts_per_s")[1:]
    if rps:
        print(f"  rollouts/s during generation: {statistics.mean(rps):.1f}")
    return 0


def rollout_lengths(rows: int, width: int, seed: int = 0) -> list[int]:
    """Trained lengths shaped like agent rollouts: log-normal (most short, a long tail), the longest = width."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.exp(0.8 * torch.randn(rows, generator=g, dtype=torch.float64))
    n = (x / x.max() * width).ceil().long().clamp(min=2)
    return n.tolist()


def bench_micro_batches(rows: int, width: int, repeats: int, overrides: list[str]) -> int:
    import time

    import torch

    from megatron_search.config import load_config
    from megatron_search.distributed import DistEnv, free_port, init_distributed
    from megatron_search.models.provider import build_model_chunks
    from megatron_search.rl.registry import build_policy_loss
    from megatron_search.train.microbatches import Batching
    from megatron_search.train.policy_step import policy_update
    from megatron_search.train.rollout_batch import RolloutBatch
    from megatron_search.trainer.step import make_optimizer, wrap_ddp

    cfg = load_config(None, ["parallel.world_size=1", "optim.lr=1e-6", *overrides])
    ctx = init_distributed(cfg, env=DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"))
    torch.manual_seed(0)
    lengths = rollout_lengths(rows, width)
    vocab = cfg.model.architecture.vocab_size
    tokens = torch.randint(0, vocab, (rows, width + 1))
    mask = torch.zeros(rows, width)
    for i, n in enumerate(lengths):
        mask[i, n // 4:n] = 1.0  # a prompt of a quarter, then the trained answer
    batch = RolloutBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.full((rows, width), -1.0),
                         mask, torch.randn(rows))
    chunks = build_model_chunks(cfg, ctx.groups)
    ddp = wrap_ddp(cfg, chunks, chunks[0].config)
    opt = make_optimizer(cfg, ddp)
    mb = cfg.grpo.micro_batch_size
    runs = {"padded to the longest": Batching(rows=mb, trim=False),
            "cut per micro-batch": Batching(rows=mb, trim=True),
            f"token budget {2 * width}": Batching(rows=mb, max_tokens=2 * width, trim=True)}
    print(f"policy update on {rows} rows, longest {width} positions, mean trained length "
          f"{sum(lengths) / rows:.0f}; {cfg.grpo.micro_batch_size} row(s) per micro-batch without a budget")
    base = None
    for name, batching in runs.items():
        times = []
        for _ in range(repeats + 1):  # the first is warm-up
            t0 = time.perf_counter()
            (m,) = policy_update(ddp, opt, batch, groups=ctx.groups, policy_loss=build_policy_loss(cfg.grpo),
                                 aggregation=cfg.grpo.loss_aggregation, batching=batching)
            times.append(time.perf_counter() - t0)
        t = min(times[1:])
        base = base or t
        print(f"  {name:<24} positions vs longest {m['positions_vs_longest']:.3f}   positions per micro-batch "
              f"{m['positions_per_micro_batch']:8.1f}   micro-batches {int(m['micro_batches']):3d}   "
              f"{t:7.3f} s   time vs padded {t / base:.3f}")
    ctx.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
