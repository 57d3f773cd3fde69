"""`megatron-search train-tokenizer`: train the tiny demo's byte-level BPE on a corpus.

    megatron-search train-tokenizer --corpus corpus.jsonl --out runs/tokenizer --vocab-size 2048

The corpus is JSONL (the `title` and `text` fields of each line are used, as in the search
corpus, or `question`/`answer`) or plain text (one document per line). The result is
runs/tokenizer/tokenizer.json with the chat tokens at ids 0..8 (see chat/tokenizer.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Iterator

from megatron_search.chat.tokenizer import PRETOKENIZERS

TEXT_FIELDS = ("title", "text", "question", "answer", "content")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-tokenizer", help="train the tiny byte-level BPE (tokenizer.json) on a corpus")
    p.add_argument("--corpus", required=True, action="append", help="JSONL or text file (repeatable)")
    p.add_argument("--out", required=True, help="output directory (tokenizer.json is written there)")
    p.add_argument("--vocab-size", type=int, default=2048, help="at most this many ids (tiny models: 2048)")
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--pretokenizer", choices=PRETOKENIZERS, default="words",
                   help="words: a space is its own token, so a word has the same tokens everywhere (copyable by "
                        "a small model); qwen: Qwen's pattern (the space glued to the next word)")
    p.set_defaults(func=run)


def iter_texts(path: str) -> Iterator[str]:
    """Documents of a JSONL file (string fields in TEXT_FIELDS) or of a plain-text file (lines)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith((".jsonl", ".json")):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                parts = [obj[k] for k in TEXT_FIELDS if isinstance(obj, dict) and isinstance(obj.get(k), str)]
                if not parts:
                    raise ValueError(f"{path}:{lineno}: no text field (one of {', '.join(TEXT_FIELDS)})")
                yield "\n".join(parts)
            else:
                yield line


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from megatron_search.chat.tokenizer import BPETokenizer

    try:
        texts = [t for path in args.corpus for t in tqdm(iter_texts(path), desc=f"reading {path}", unit=" docs")]
        tok = BPETokenizer.train(texts, vocab_size=args.vocab_size, min_frequency=args.min_frequency,
                                 show_progress=True, pretokenizer=args.pretokenizer)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = tok.save(args.out)
    print(f"trained on {len(texts)} documents: {tok.vocab_size} ids -> {path}")
    return 0
