#!/usr/bin/env python
"""Forward + backward time of the tiny Qwen3.5 hybrid: Megatron-Core on CPU vs HF transformers (baseline).

    python tools/bench_qwen3_5_model.py                       # 8 x 128 tokens, best of 3
    python tools/bench_qwen3_5_model.py --batch 4 --seq 512 --repeats 2

Both models hold the same weights (HF random init, converted with the rules of
docs/QWEN3_5_LAYOUT.md), and the script first checks that their logits agree. Megatron runs in this
process as a 1-rank gloo job (local specs, torch gated delta rule); HF runs its own torch fallbacks
(no fla / causal-conv1d). Loss: mean next-token cross entropy. One torch thread by default.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs/models/tiny_qwen3_5_moe"


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in tqdm(range(repeats), leave=False):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO / "tests"))
    from test_models_qwen3_5 import _randomised_hf_model, hf_to_megatron  # the checked conversion

    from megatron_search.config.loader import config_from_dict
    from megatron_search.distributed import init_distributed
    from megatron_search.models.provider import build_model

    cfg = config_from_dict({"model": {"hf_config": str(TINY)}})
    ctx = init_distributed(cfg)
    try:
        text = json.loads((TINY / "config.json").read_text())["text_config"]
        hf = _randomised_hf_model(seed=3).train()
        mc = build_model(cfg, ctx.groups)
        mc.load_state_dict(hf_to_megatron(hf.state_dict(), text), strict=False)
        b, t = args.batch, args.seq
        ids = torch.randint(0, text["vocab_size"], (b, t), generator=torch.Generator().manual_seed(0))
        labels = torch.roll(ids, -1, dims=1)
        pos = torch.arange(t).expand(b, t)
        with torch.no_grad():
            diff = (mc(input_ids=ids, position_ids=pos, attention_mask=None) - hf(input_ids=ids).logits).abs().max()

        def hf_step():
            hf.zero_grad(set_to_none=True)
            logits = hf(input_ids=ids).logits
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()

        def mc_step():
            mc.zero_grad(set_to_none=True)
            mc(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels).float().mean().backward()

        hf_s = _best(hf_step, args.repeats)
        mc_s = _best(mc_step, args.repeats)
    finally:
        ctx.teardown()
    print(f"tiny Qwen3.5 (4 layers: 3 GDN + 1 gated attention, 4 experts), {b} x {t} tokens, fp32, "
          f"{args.threads} thread(s), best of {args.repeats}; logits max |diff| {float(diff):.1e}")
    print(f"  HF transformers  {hf_s:8.3f} s   1.00x")
    print(f"  Megatron-Core    {mc_s:8.3f} s   {mc_s / hf_s:.2f}x the HF time")


if __name__ == "__main__":
    main()
