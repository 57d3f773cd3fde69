"""Mechanical grading of rubrics whose wording is a known, objective pattern.

The RECIPE 4.2 rubrics are atomic and objective, and many follow a few shapes: the reply's
language, quoted strings that must (not) appear, citation markers, word limits, bullet lists. Those
are graded here without an LLM (exactly and for free); `check_rubric` returns None for anything else,
which then goes to the LLM judge. Used by the rubric pipeline's judge and usable as an RL grader.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Optional


_QUOTED = re.compile(r"\"([^\"]+)\"|“([^”]+)”|'([^']+)'")
_SUBJ = r"(?:the (?:answer|reply|response|corrected sentence|rewritten text|text)|it|its answer)"
_LANG = re.compile(rf"^{_SUBJ} is (?:written )?(?:entirely )?in ([A-Za-z]+)\.?$", re.I)
_CITATIONS = re.compile(rf"^{_SUBJ} (?:has|contains|includes) no citation markers\b", re.I)
_NEG = re.compile(rf"^{_SUBJ} (?:has no|contains no|includes no|uses no|does not (?:contain|include|use|mention)) (.+)$", re.I)
_POS = re.compile(rf"^{_SUBJ} (?:contains|includes|uses|mentions) (.+)$", re.I)
_MAX_WORDS = re.compile(rf"^{_SUBJ} (?:has|is) at most (\d+) words\.?$", re.I)
_MIN_WORDS = re.compile(rf"^{_SUBJ} (?:has|is) at least (\d+) words\.?$", re.I)
_BULLETS = re.compile(rf"^{_SUBJ} (?:is|is formatted as|uses) a bulleted list\.?$|^{_SUBJ} uses bullet points\.?$", re.I)
CITATION_MARKER = re.compile(r"\[[a-z_]+:\d+\]", re.I)
_LANGS = ("ENGLISH", "FRENCH", "GERMAN", "SPANISH", "ITALIAN", "PORTUGUESE", "DUTCH", "RUSSIAN", "CHINESE",
          "JAPANESE", "KOREAN", "ARABIC", "HINDI", "TURKISH", "POLISH")


@lru_cache(maxsize=1)
def _detector():
    # start-up: lingua (its language models, 96 MB installed) only where a rubric checks a reply's language
    from lingua import Language, LanguageDetectorBuilder

    # low-accuracy mode (trigram models only) builds in a fraction of a second; replies are sentences,
    # not single words, where it is accurate enough
    return LanguageDetectorBuilder.from_languages(*(getattr(Language, n) for n in _LANGS)).with_low_accuracy_mode().build()


def detect_language(text: str) -> Optional[str]:
    lang = _detector().detect_language_of(text)
    return lang.name.lower() if lang is not None else None


def _quoted(s: str) -> list[str]:
    return [next(g for g in m.groups() if g is not None) for m in _QUOTED.finditer(s)]


def _present(item: str, text: str) -> bool:
    """Case-insensitive; alphanumeric items must match whole words ("u" is not in "manpower")."""
    if re.fullmatch(r"\w+", item):
        return re.search(rf"(?<!\w){re.escape(item)}(?!\w)", text, re.I) is not None
    return item.lower() in text.lower()


def check_rubric(rubric: str, response: str) -> Optional[bool]:
    """True/False when the rubric has a mechanically checkable form, else None (needs a judge)."""
    r = rubric.strip()
    m = _LANG.match(r)
    if m:
        want = m.group(1).upper()
        if want not in _LANGS:
            return None
        return detect_language(response) == want.lower()
    if _CITATIONS.match(r):
        return CITATION_MARKER.search(response) is None
    m = _MAX_WORDS.match(r)
    if m:
        return len(response.split()) <= int(m.group(1))
    m = _MIN_WORDS.match(r)
    if m:
        return len(response.split()) >= int(m.group(1))
    if _BULLETS.match(r):
        return sum(bool(re.match(r"\s*[-*•]\s+\S", line)) for line in response.splitlines()) >= 2
    m = _NEG.match(r)
    if m and _quoted(m.group(1)):
        return not any(_present(q, response) for q in _quoted(m.group(1)))
    m = _POS.match(r)
    if m and _quoted(m.group(1)):
        items = _quoted(m.group(1))
        rest = _QUOTED.sub("", m.group(1)).lower()
        if re.search(r"\bor\b", rest) and not re.search(r"\band\b", rest):
            return any(_present(q, response) for q in items)
        return all(_present(q, response) for q in items)
    return None
