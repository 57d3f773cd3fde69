"""`megatron-search build-index`: build the local search_web index from a JSONL corpus.

    megatron-search build-index --corpus corpus.jsonl --index-dir runs/index
    megatron-search build-index configs/tiny_cpu.yaml search.corpus=c.jsonl search.index_dir=runs/index
    megatron-search build-index ... --query "who wrote The Mom Test"   # then try a query
"""
from __future__ import annotations

import argparse
import sys

from .common import add_config_args, load_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build-index", help="build the local search index (bm25s) from a JSONL corpus")
    add_config_args(p)
    p.add_argument("--corpus", help="JSONL corpus with id, title, url, text (default: search.corpus)")
    p.add_argument("--index-dir", help="output directory (default: search.index_dir)")
    p.add_argument("--query", action="append", default=[], help="run this query on the new index and print the hits")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_search.search import SearchBackendError
    from megatron_search.search.local import CorpusError, LocalSearchBackend, build_index, read_corpus

    cfg = load_from_args(args).search
    corpus = args.corpus or cfg.corpus
    index_dir = args.index_dir or cfg.index_dir
    if not corpus or not index_dir:
        print("error: give --corpus and --index-dir (or search.corpus / search.index_dir)", file=sys.stderr)
        return 2
    try:
        n = build_index(read_corpus(corpus, progress=True), index_dir, progress=True)
    except (OSError, CorpusError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"indexed {n} documents from {corpus} into {index_dir}")
    if args.query:
        try:
            backend = LocalSearchBackend.load(index_dir, cfg.snippet_chars)
        except SearchBackendError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for q in args.query:
            print(f"\nquery: {q}")
            for i, hit in enumerate(backend.search(q, cfg.max_results), 1):
                print(f"  [{i}] {hit.title} <{hit.url}> ({hit.doc_id})")
    return 0
