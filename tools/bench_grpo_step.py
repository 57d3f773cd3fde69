#!/usr/bin/env python
"""Seconds per GRPO step, split by phase, for the demo config on this machine (CPU).

Builds the demo's world/data/tokenizer and a briefly trained reward model in a scratch directory
(the demo's own stages), runs `megatron-search grpo` for a few steps from the random-init policy,
and prints the mean of each phase over the steps after the first (the first pays for process
warm-up and the reference answers):

    python tools/bench_grpo_step.py [--steps 4] [--out /tmp/bench_grpo] [key=value ...]
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
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

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


if __name__ == "__main__":
    sys.exit(main())
