"""Throughput of the search-agent loop against the local CPU engine server (over HTTP).

Starts the local engine server (tiny random model), trains a 2,048-id BPE so every sampled id
decodes, then runs the agent loop at each concurrency level and prints rollouts/s, model
tokens/s and the speed-up over concurrency 1 measured in the same run. A random model seldom
calls tools, so this measures the engine + loop path; tools/bench_search.py measures search.

    python tools/bench_rollout.py [--model configs/models/tiny_qwen3_5_moe] [--levels 1 8 64]
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

from megatron_search.rollout.agent import AgentSettings, AgentTask, SearchAgent  # noqa: E402
from megatron_search.rollout.chat_format import ChatFormat  # noqa: E402
from megatron_search.rollout.sglang import SGLangClient, launch_local_server  # noqa: E402
from megatron_search.rollout.tokenizer import BPETokenizer, ChatEncoder  # noqa: E402
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
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        tok, tok_path = train_tokenizer(Path(tmp))
        style = "qwen3_5" if "qwen3_5" in args.model else "qwen3"
        enc = ChatEncoder(tok, ChatFormat(style))
        overrides = [f"model.hf_config={args.model}", f"rollout.local.max_running_requests={max(args.levels)}"]
        server = launch_local_server(overrides=overrides, log_path=Path(tmp) / "server.log", timeout_s=600,
                                     env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
        try:
            asyncio.run(run_level(server.url, enc, 1, 1, args.max_new_tokens))  # warm-up, not reported
            rows = []
            for level in args.levels:
                n = args.rollouts or min(128, max(4, 2 * level))
                rows.append(asyncio.run(run_level(server.url, enc, level, n, args.max_new_tokens)))
        finally:
            server.stop()

    base = rows[0]
    print(f"\nagent loop vs local engine over HTTP: {args.model}, {args.max_new_tokens} new tokens per turn, "
          f"temperature 1.0, CPU threads {os.environ.get('OMP_NUM_THREADS', '2')}")
    print(f"{'concurrency':>11} {'rollouts':>8} {'secs':>7} {'rollouts/s':>10} {'tokens/s':>9} {'x vs c=' + str(base['concurrency']):>9}")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['rollouts']:>8} {r['secs']:>7.2f} {r['rollouts_s']:>10.2f} "
              f"{r['tokens_s']:>9.1f} {r['tokens_s'] / base['tokens_s']:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
