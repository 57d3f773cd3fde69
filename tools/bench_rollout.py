"""Throughput of the search-agent loop against the local CPU engine server (over HTTP).

Starts the local engine server (tiny random model), trains a 2,048-id BPE so every sampled id
decodes, then runs the agent loop at each concurrency level and prints rollouts/s, model
tokens/s and the speed-up over concurrency 1 measured in the same run. Beside each level it
prints plain transformers `generate` on the same model (same seed, prompts as long as the
agent's, the same new tokens, temperature 1, full vocabulary) at batch = concurrency, and our
tokens/s as a fraction of it: the baseline the engine is held to (issue 21.3: at the highest level
>= 0.5x of generate and >= 10x our own rate at concurrency 1). A random model seldom calls tools,
so this measures the engine + loop path; tools/bench_search.py measures search.

    python tools/bench_rollout.py [--model configs/models/tiny_qwen3_5_moe] [--levels 1 8 64] [--no-generate]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_search.rollout.agent.loop import AgentSettings, AgentTask, SearchAgent  # noqa: E402
from megatron_search.chat.format import ChatFormat  # noqa: E402
from megatron_search.rollout.local.runner import load_hf_model  # noqa: E402
from megatron_search.rollout.sglang.client import SGLangClient  # noqa: E402
from megatron_search.rollout.local.launch import launch_local_server
from megatron_search.chat.tokenizer import BPETokenizer, ChatEncoder  # noqa: E402
from megatron_search.search.base import SearchBackend, SearchResult  # noqa: E402
from megatron_search.search.tool import SearchTool  # noqa: E402


class OneDoc(SearchBackend):
    name = "one-doc"

    def search(self, query, k):
        return [SearchResult("title", "https://example.org", "snippet", "d0")]


def train_tokenizer(out_dir: Path) -> tuple[BPETokenizer, str]:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(4000)]
    tok = BPETokenizer.train([" ".join(rng.choice(words) for _ in range(50)) for _ in range(800)], vocab_size=2048)
    return tok, str(tok.save(out_dir))


def prompt_len(enc: ChatEncoder) -> int:
    """Tokens of the agent's first prompt (system + search_web tool + question), as run_level renders it."""
    return len(enc.prompt_ids([{"role": "user", "content": "question number 0"}], [SearchTool(OneDoc()).spec]))


@torch.no_grad()
def generate_baseline(m: torch.nn.Module, prompt_tokens: int, batch: int, max_new_tokens: int, repeats: int = 2,
                      seed: int = 0) -> dict:
    """New tokens/s of transformers `generate` (its own DynamicCache loop, prefill included, sampling at
    temperature 1 over the full vocabulary) on the engine's model for `batch` random prompts; best of `repeats`."""
    vocab = int(m.config.get_text_config(decoder=True).vocab_size)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt_tokens), generator=g)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0,
              max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    m.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
    reps = max(1, 8 // batch)  # small batches are short: repeat them for a steadier figure
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(reps):
            out = m.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        secs = time.perf_counter() - start
        new = (out.shape[1] - prompt_tokens) * batch * reps
        if best is None or new / secs > best["tokens_s"]:
            best = {"batch": batch, "secs": secs, "tokens_s": new / secs}
    return best


async def run_level(url: str, enc: ChatEncoder, concurrency: int, rollouts: int, max_new_tokens: int) -> dict:
    client = SGLangClient(url)
    settings = AgentSettings(max_new_tokens=max_new_tokens, max_total_tokens=4096, temperature=1.0,
                             concurrency=concurrency)
    agent = SearchAgent(client, enc, SearchTool(OneDoc()), settings)
    tasks = [AgentTask([{"role": "user", "content": f"question number {i}"}], seed=i) for i in range(rollouts)]
    start = time.perf_counter()
    try:
        out = await agent.run_many(tasks, desc=f"concurrency {concurrency}")
    finally:
        await client.close()
    secs = time.perf_counter() - start
    model_tokens = sum(r.num_model_tokens for r in out)
    return {"concurrency": concurrency, "rollouts": rollouts, "secs": secs, "rollouts_s": rollouts / secs,
            "tokens_s": model_tokens / secs, "model_tokens": model_tokens}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="configs/models/tiny_qwen3_moe", help="HF config directory (tiny models)")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 8, 64], help="concurrent rollouts")
    p.add_argument("--rollouts", type=int, default=0, help="rollouts per level (default: max(4, 2 x level) capped at 128)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--no-generate", action="store_true", help="skip the transformers generate baseline")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per level, best kept (CPU cores shared with other work make single runs noisy)")
    args = p.parse_args()
    threads = os.environ.get("OMP_NUM_THREADS", "2")
    torch.set_num_threads(int(threads))  # the baseline runs in this process, with the server's thread count

    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        tok, tok_path = train_tokenizer(Path(tmp))
        style = "qwen3_5" if "qwen3_5" in args.model else "qwen3"
        enc = ChatEncoder(tok, ChatFormat(style))
        overrides = [f"model.hf_config={args.model}", f"rollout.local.max_running_requests={max(args.levels)}"]
        server = launch_local_server(overrides=overrides, log_path=Path(tmp) / "server.log", timeout_s=600,
                                     env={**os.environ, "OMP_NUM_THREADS": threads})
        try:
            asyncio.run(run_level(server.url, enc, 1, 1, args.max_new_tokens))  # warm-up, not reported
            rows = []
            for level in args.levels:
                n = args.rollouts or min(128, max(4, 2 * level))
                runs = [asyncio.run(run_level(server.url, enc, level, n, args.max_new_tokens))
                        for _ in range(max(1, args.repeats))]
                rows.append(max(runs, key=lambda r: r["tokens_s"]))
        finally:
            server.stop()
        n_prompt = prompt_len(enc)
    # after the server has stopped, so the two never share the cores
    gen = {}
    if not args.no_generate:
        model = load_hf_model(args.model, seed=0)  # the server's weights (rollout.local.seed 0)
        gen = {lv: generate_baseline(model, n_prompt, lv, args.max_new_tokens, max(1, args.repeats)) for lv in args.levels}

    base = rows[0]
    print(f"\nagent loop vs local engine over HTTP: {args.model}, {n_prompt}-token prompts, {args.max_new_tokens} new "
          f"tokens per turn, temperature 1.0, CPU threads {threads}, best of {max(1, args.repeats)} runs")
    head = f"{'concurrency':>11} {'rollouts':>8} {'secs':>7} {'rollouts/s':>10} {'tokens/s':>9} {'x vs c=' + str(base['concurrency']):>9}"
    print(head + (f" {'generate tok/s':>14} {'x generate':>10}" if gen else ""))
    for r in rows:
        line = (f"{r['concurrency']:>11} {r['rollouts']:>8} {r['secs']:>7.2f} {r['rollouts_s']:>10.2f} "
                f"{r['tokens_s']:>9.1f} {r['tokens_s'] / base['tokens_s']:>9.2f}")
        if gen:
            g = gen[r["concurrency"]]["tokens_s"]
            line += f" {g:>14.1f} {r['tokens_s'] / g:>10.2f}"
        print(line)
    top = rows[-1]
    if gen and len(rows) > 1:
        ratio, speedup = top["tokens_s"] / gen[top["concurrency"]]["tokens_s"], top["tokens_s"] / base["tokens_s"]
        print(f"at concurrency {top['concurrency']}: {ratio:.2f}x generate (target >= 0.5), {speedup:.1f}x our "
              f"c={base['concurrency']} rate (target >= 10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
