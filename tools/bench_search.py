#!/usr/bin/env python
"""Latency of the local search backend (bm25s) on a generated corpus, vs a baseline in the same run.

    python tools/bench_search.py                 # 100,000 documents, 500 queries, top-10
    python tools/bench_search.py --docs 20000 --queries 200

Prints p50/p95 per-query latency of: the bm25s backend (`LocalSearchBackend.search`), the
agent's path (`ToolSession.execute`: limits, worker thread, formatting), and the baseline, a
plain-Python inverted-index BM25 over the same tokens (term-at-a-time, dict accumulator).
The baseline also checks the answers: the share of queries whose top-1 document agrees.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tqdm import tqdm  # noqa: E402

from megatron_search.search import SearchTool, ToolCall  # noqa: E402
from megatron_search.search.local import LocalSearchBackend, _tokenize, build_index  # noqa: E402

SYLLABLES = [a + b for a in "bcdfghklmnprstvz" for b in ("a", "e", "i", "o", "u", "ar", "en", "is", "on")]


def make_vocabulary(n: int, rng: random.Random) -> list[str]:
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))))
    return sorted(words)


def make_corpus(n_docs: int, seed: int) -> list[dict]:
    """Short documents (title + 30-80 words) with Zipf-distributed words, like encyclopedia abstracts."""
    rng = random.Random(seed)
    vocab = make_vocabulary(50_000, rng)
    weights = [1.0 / (r + 1) for r in range(len(vocab))]
    cum = list(_accumulate(weights))
    docs = []
    for i in tqdm(range(n_docs), desc="generating corpus", unit=" docs"):
        words = rng.choices(vocab, cum_weights=cum, k=rng.randint(30, 80))
        title = " ".join(rng.choices(vocab, cum_weights=cum, k=rng.randint(2, 4))).title()
        docs.append({"id": f"d{i}", "title": title, "url": f"https://example.org/d{i}", "text": " ".join(words) + "."})
    return docs


def _accumulate(xs):
    total = 0.0
    for x in xs:
        total += x
        yield total


def make_queries(docs: list[dict], n: int, seed: int) -> list[str]:
    """Queries of 2-6 words drawn from a random document (title words first), like a model's queries."""
    rng = random.Random(seed + 1)
    out = []
    for _ in range(n):
        d = rng.choice(docs)
        words = d["title"].lower().split() + rng.sample(d["text"].rstrip(".").split(), 4)
        out.append(" ".join(words[: rng.randint(2, 6)]))
    return out


class PythonBM25:
    """Baseline: textbook BM25 (k1=1.5, b=0.75, Lucene idf), inverted index in dicts, term-at-a-time."""

    def __init__(self, token_lists: list[list[str]], k1: float = 1.5, b: float = 0.75):
        self.k1, self.b = k1, b
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.lengths = [len(t) for t in token_lists]
        self.avgdl = sum(self.lengths) / len(self.lengths)
        for i, toks in enumerate(token_lists):
            for term, tf in Counter(toks).items():
                self.postings[term].append((i, tf))
        n = len(token_lists)
        self.idf = {t: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()}

    def search(self, terms: list[str], k: int) -> list[int]:
        scores: dict[int, float] = defaultdict(float)
        for term in terms:
            idf = self.idf.get(term)
            if idf is None:
                continue
            for doc, tf in self.postings[term]:
                norm = tf + self.k1 * (1 - self.b + self.b * self.lengths[doc] / self.avgdl)
                scores[doc] += idf * tf * (self.k1 + 1) / norm
        return [d for d, _ in sorted(scores.items(), key=lambda x: -x[1])[:k]]


def percentiles(samples: list[float]) -> tuple[float, float]:
    qs = statistics.quantiles(samples, n=100, method="inclusive")
    return qs[49] * 1e3, qs[94] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    docs = make_corpus(args.docs, args.seed)
    queries = make_queries(docs, args.queries, args.seed)
    with tempfile.TemporaryDirectory(prefix="bench_search_") as tmp:
        t0 = time.perf_counter()
        build_index(docs, os.path.join(tmp, "index"), progress=True)
        build_s = time.perf_counter() - t0
        backend = LocalSearchBackend.load(os.path.join(tmp, "index"))

    backend.search(queries[0], args.k)  # warm-up (lazy numba/numpy paths)
    bm25s_lat, top1 = [], []
    for q in tqdm(queries, desc="bm25s backend", unit=" q"):
        t = time.perf_counter()
        hits = backend.search(q, args.k)
        bm25s_lat.append(time.perf_counter() - t)
        top1.append(hits[0].doc_id if hits else None)

    tool = SearchTool(backend, max_results=args.k)

    async def tool_path() -> list[float]:
        session = tool.session(budget=len(queries))
        lat = []
        for q in tqdm(queries, desc="search_web tool", unit=" q"):
            t = time.perf_counter()
            await session.execute(ToolCall("search_web", {"query": q}))
            lat.append(time.perf_counter() - t)
        return lat

    tool_lat = asyncio.run(tool_path())

    base = PythonBM25(_tokenize([f"{d['title']}\n{d['text']}" for d in docs], True))
    base_lat, agree = [], 0
    for q, first in tqdm(list(zip(queries, top1)), desc="python BM25 baseline", unit=" q"):
        terms = _tokenize([q], False)[0]
        t = time.perf_counter()
        ids = base.search(terms, args.k)
        base_lat.append(time.perf_counter() - t)
        agree += bool(ids) and first == docs[ids[0]]["id"]

    b50, b95 = percentiles(bm25s_lat)
    t50, t95 = percentiles(tool_lat)
    p50, p95 = percentiles(base_lat)
    print(f"\ncorpus: {len(docs):,} documents, {len(queries)} queries, top-{args.k}; index build {build_s:.1f} s")
    print(f"{'path':<28}{'p50 ms':>10}{'p95 ms':>10}")
    print(f"{'bm25s backend':<28}{b50:>10.2f}{b95:>10.2f}")
    print(f"{'search_web tool (async)':<28}{t50:>10.2f}{t95:>10.2f}")
    print(f"{'python BM25 baseline':<28}{p50:>10.2f}{p95:>10.2f}")
    print(f"speed-up of bm25s over the baseline: p50 x{p50 / b50:.1f}, p95 x{p95 / b95:.1f}")
    print(f"top-1 agreement with the baseline: {agree / len(queries):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
