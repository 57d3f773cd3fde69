#!/usr/bin/env python
"""Time of the torch gated delta rule, forward + backward: chunked vs the token recurrence (baseline).

    python tools/bench_gdn.py                          # T in {256, 1024}, 4 heads, dk = dv = 64, fp32
    python tools/bench_gdn.py --tokens 512,2048 --chunk-sizes 32,64,128 --repeats 3

Cases, all measured in this run on the same inputs:
  recurrent   models.gdn_torch.recurrent_gated_delta_rule (the definition; baseline of the ratios)
  chunk{C}    models.gdn_torch.chunk_gated_delta_rule with chunk_size C
  hf_chunk    transformers' Qwen3.5 torch_chunk_gated_delta_rule (what HF runs without fla), if importable
Each case also reports max |o - o_recurrent| (fp32). Time = best of --repeats runs.
Default one torch thread (shared 2-core machines); pass --threads to change it.
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from megatron_search.models.gdn_torch import chunk_gated_delta_rule, recurrent_gated_delta_rule


def _inputs(b: int, t: int, h: int, dk: int, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=gen)
    k = torch.randn(b, t, h, dk, generator=gen)
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen)
    beta = torch.rand(b, t, h, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _hf_chunk():
    try:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule
    except ImportError:
        return None
    return torch_chunk_gated_delta_rule


def _time(fn, xs, repeats: int) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(repeats):
        for x in xs:
            x.grad = None
        start = time.perf_counter()
        o, _ = fn(*xs)
        o.sum().backward()
        best = min(best, time.perf_counter() - start)
        out = o.detach()
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="256,1024", help="comma-separated sequence lengths")
    ap.add_argument("--chunk-sizes", default="64", help="comma-separated chunk sizes")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cases = {"recurrent": lambda *x: recurrent_gated_delta_rule(*x, use_qk_l2norm_in_kernel=True)}
    for c in (int(s) for s in args.chunk_sizes.split(",")):
        cases[f"chunk{c}"] = lambda *x, c=c: chunk_gated_delta_rule(*x, use_qk_l2norm_in_kernel=True, chunk_size=c)
    hf = _hf_chunk()
    if hf is not None:
        cases["hf_chunk"] = lambda *x: hf(*x, use_qk_l2norm_in_kernel=True)

    rows = []
    lengths = [int(s) for s in args.tokens.split(",")]
    for t in tqdm(lengths, desc="sequence lengths"):
        xs = _inputs(args.batch, t, args.heads, args.head_dim, args.head_dim)
        base_s, base_o = _time(cases["recurrent"], xs, args.repeats)
        for name, fn in cases.items():
            s, o = (base_s, base_o) if name == "recurrent" else _time(fn, xs, args.repeats)
            rows.append((t, name, s, base_s / s, float((o - base_o).abs().max())))

    print(f"B={args.batch} H={args.heads} dk=dv={args.head_dim} fp32, forward+backward, "
          f"best of {args.repeats}, {args.threads} thread(s)")
    print(f"{'T':>6} {'case':>10} {'seconds':>9} {'speedup vs recurrent':>21} {'max|o - o_rec|':>15}")
    for t, name, s, speedup, diff in rows:
        print(f"{t:>6} {name:>10} {s:>9.4f} {speedup:>21.2f} {diff:>15.2e}")


if __name__ == "__main__":
    main()
