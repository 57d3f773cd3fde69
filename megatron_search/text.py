"""Text normalisation shared by data filters and answer matching (bottom of the layering: no deps).

The convention of search-agent QA peers (FACTS.md, SQuAD-style): case-fold, delete punctuation
(any Unicode punctuation, not only ASCII), drop the articles a/an/the, collapse whitespace.
"""
from __future__ import annotations

import re
import unicodedata

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SPACES = re.compile(r"\s+")


def normalize_answer(text: str) -> str:
    """Case-fold, delete punctuation, drop articles a/an/the, collapse whitespace."""
    if not isinstance(text, str):
        raise TypeError(f"answer: expected str, got {type(text).__name__}")
    text = text.casefold()
    text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("P"))
    text = _ARTICLES.sub(" ", text)
    return _SPACES.sub(" ", text).strip()
