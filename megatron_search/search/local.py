"""Local search backend: a bm25s (BM25) index over a JSONL corpus; the embedded default.

Corpus format: one JSON object per line with string fields `id`, `title`, `url`, `text`.
An index directory holds the bm25s arrays, `docs.jsonl` (the documents, in index order) and
`meta.json`. It is written to a temporary directory and renamed into place, so a crashed
build never leaves a half-written index behind.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Optional

import bm25s
from tqdm import tqdm

from .base import SearchBackend, SearchBackendError, SearchResult

INDEX_FORMAT = 1
REQUIRED_FIELDS = ("id", "title", "url", "text")
# bm25s tokenisation shared by index and queries (they must match): lower-case, English stopwords.
_STOPWORDS = "en"
_WORD = re.compile(r"\w\w+", re.UNICODE)


class CorpusError(ValueError):
    """A corpus line is not a valid document."""


def read_corpus(path: str | os.PathLike, progress: bool = False) -> Iterator[dict]:
    """Yield the documents of a JSONL corpus, checking each line (errors name file and line)."""
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(tqdm(f, desc="reading corpus", unit=" docs", disable=not progress), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(doc, dict):
                raise CorpusError(f"{path}:{lineno}: expected a JSON object, got {type(doc).__name__}")
            for field in REQUIRED_FIELDS:
                if not isinstance(doc.get(field), str):
                    raise CorpusError(f"{path}:{lineno}: field {field!r} must be a string (got {doc.get(field)!r:.60})")
            if doc["id"] in seen:
                raise CorpusError(f"{path}:{lineno}: duplicate document id {doc['id']!r}")
            seen.add(doc["id"])
            yield {k: doc[k] for k in REQUIRED_FIELDS}


def _tokenize(texts: list[str], progress: bool) -> list[list[str]]:
    return bm25s.tokenize(texts, lower=True, stopwords=_STOPWORDS, return_ids=False, show_progress=progress)


def build_index(docs: Iterable[dict], index_dir: str | os.PathLike, progress: bool = True) -> int:
    """Index `docs` (dicts with id/title/url/text) into `index_dir`; returns the document count."""
    docs = list(docs)
    if not docs:
        raise CorpusError("the corpus has no documents")
    index_dir = Path(index_dir)
    index_dir.parent.mkdir(parents=True, exist_ok=True)
    tokens = _tokenize([f"{d['title']}\n{d['text']}" for d in docs], progress)
    retriever = bm25s.BM25()
    retriever.index(tokens, show_progress=progress)
    tmp = Path(tempfile.mkdtemp(prefix=f".{index_dir.name}.tmp-", dir=index_dir.parent))
    try:
        retriever.save(str(tmp), show_progress=False)
        with open(tmp / "docs.jsonl", "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        (tmp / "meta.json").write_text(json.dumps({"format": INDEX_FORMAT, "num_docs": len(docs), "backend": "bm25s"}))
        old = None
        if index_dir.exists():
            old = index_dir.with_name(f".{index_dir.name}.old-{os.getpid()}")
            os.replace(index_dir, old)
        os.replace(tmp, index_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len(docs)


def make_snippet(text: str, query_terms: set[str], chars: int) -> str:
    """About `chars` characters of `text` around the first query term it contains (else its start)."""
    if len(text) <= chars:
        return text
    start = 0
    for m in _WORD.finditer(text):
        if m.group().lower() in query_terms:
            start = max(0, m.start() - chars // 4)
            break
    if start > 0:  # do not cut a word in half
        space = text.find(" ", start)
        start = space + 1 if 0 <= space < start + 20 else start
    end = min(len(text), start + chars)
    if end < len(text):
        space = text.rfind(" ", start, end)
        end = space if space > start + chars // 2 else end
    return ("..." if start > 0 else "") + text[start:end].strip() + ("..." if end < len(text) else "")


class LocalSearchBackend(SearchBackend):
    """BM25 over a local corpus. Thread-safe for concurrent queries (the index is read-only)."""

    name = "local"

    def __init__(self, retriever: "bm25s.BM25", docs: list[dict], snippet_chars: int = 300):
        if len(docs) != retriever.scores["num_docs"]:
            raise SearchBackendError(
                f"index has {retriever.scores['num_docs']} documents but docs.jsonl has {len(docs)}: rebuild the index"
            )
        self._retriever = retriever
        self._docs = docs
        self.snippet_chars = snippet_chars

    @classmethod
    def load(cls, index_dir: str | os.PathLike, snippet_chars: int = 300) -> "LocalSearchBackend":
        index_dir = Path(index_dir)
        meta_path = index_dir / "meta.json"
        if not meta_path.is_file():
            raise SearchBackendError(
                f"{index_dir} is not a search index (no meta.json); build one with tools/build_search_index.py"
            )
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != INDEX_FORMAT:
            raise SearchBackendError(f"{index_dir}: index format {meta.get('format')} != {INDEX_FORMAT}; rebuild it")
        retriever = bm25s.BM25.load(str(index_dir), show_progress=False)
        with open(index_dir / "docs.jsonl", encoding="utf-8") as f:
            docs = [json.loads(line) for line in f]
        return cls(retriever, docs, snippet_chars)

    @classmethod
    def from_docs(cls, docs: Iterable[dict], snippet_chars: int = 300) -> "LocalSearchBackend":
        """An in-memory index (tests, small synthetic worlds); nothing is written to disk."""
        docs = list(docs)
        if not docs:
            raise CorpusError("the corpus has no documents")
        retriever = bm25s.BM25()
        retriever.index(_tokenize([f"{d['title']}\n{d['text']}" for d in docs], False), show_progress=False)
        return cls(retriever, docs, snippet_chars)

    def __len__(self) -> int:
        return len(self._docs)

    def search(self, query: str, k: int) -> list[SearchResult]:
        if k <= 0:
            return []
        terms = _tokenize([query], False)
        if not terms or not terms[0]:
            return []  # only stopwords / punctuation: nothing to match
        k = min(k, len(self._docs))
        ids, scores = self._retriever.retrieve(terms, k=k, show_progress=False, n_threads=0)
        term_set = set(terms[0])
        out = []
        for i, score in zip(ids[0].tolist(), scores[0].tolist()):
            if score <= 0.0:  # bm25s pads with zero-score documents that match no term
                continue
            d = self._docs[i]
            out.append(SearchResult(d["title"], d["url"], make_snippet(d["text"], term_set, self.snippet_chars), d["id"]))
        return out


def load_or_build(index_dir: Optional[str], corpus: Optional[str], snippet_chars: int) -> LocalSearchBackend:
    """The configured local backend: load `index_dir`, building it from `corpus` first when missing."""
    if index_dir and (Path(index_dir) / "meta.json").is_file():
        return LocalSearchBackend.load(index_dir, snippet_chars)
    if corpus is None:
        raise SearchBackendError(
            "search.backend=local needs search.index_dir (an existing index) or search.corpus (a JSONL corpus)"
        )
    if not index_dir:
        return LocalSearchBackend.from_docs(read_corpus(corpus), snippet_chars)
    build_index(read_corpus(corpus), index_dir, progress=False)
    return LocalSearchBackend.load(index_dir, snippet_chars)
