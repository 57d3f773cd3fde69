"""Public QA sets converted to the common record schema (records.QARecord), plus the quality filters
of RECIPE 4.1's public baseline and scale matching of the synthetic set.

Training sets: DeepDive, SealQA, Bamboogle (Press et al. 2023), WebShaper, WebWalkerQA. Evaluation
sets converted too, for the eval/train overlap filter: SimpleQA and FRAMES. Column layouts follow each
dataset's published files (FACTS.md); column names are matched case-insensitively because copies
differ (WebWalkerQA's card writes `Question`/`Root_Url`/`Info`, its files `question`/...).
Files are read through Hugging Face `datasets` (data/hf_datasets.py): a single file, a folder in the
Hub's layout or a save_to_disk folder, eagerly (memory-mapped Arrow) or streamed (`streaming=True`,
for sets larger than memory). A bad row raises an error naming file and line (text formats) or file
and row (parquet / Arrow), or is skipped and counted (on_error="skip").
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from tqdm import tqdm

from .jsonl import DataError, SkipCounter
from megatron_search.text import normalize_answer

from .hf_datasets import iter_rows
from .records import QARecord

TRAIN_SOURCES = ("deepdive", "sealqa", "bamboogle", "webshaper", "webwalkerqa")
EVAL_SOURCES = ("simpleqa", "frames")


def _get(row: dict, *names: str, required: bool = True) -> Any:
    lower = {str(k).lower(): v for k, v in row.items()}
    for n in names:
        if n.lower() in lower:
            return lower[n.lower()]
    if required:
        raise KeyError(f"missing column {names[0]!r} (have {sorted(row)})")
    return None


def _answers(value: Any) -> list[str]:
    """A gold answer cell as a list of strings (single string, list, or a JSON list in a string)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value if str(v).strip()]
    s = str(value).strip()
    if s.startswith("[") and s.endswith("]"):
        try:
            parsed = json.loads(s)
            if isinstance(parsed, list):
                return [str(v).strip() for v in parsed if str(v).strip()]
        except ValueError:
            pass
    return [s] if s else []


def _jsonable(v: Any) -> Any:
    return json.loads(json.dumps(v, default=str))


def _deepdive(row: dict) -> tuple[str, list[str], dict, Optional[str]]:
    conv = _get(row, "conversations", required=False)
    return _get(row, "question"), _answers(_get(row, "answer")), {"turns": len(conv) if conv is not None else 0}, \
        _get(row, "id", required=False)


def _sealqa(row: dict):
    meta = {k: _jsonable(_get(row, k, required=False)) for k in ("urls", "freshness", "question_types", "effective_year", "topic")}
    return _get(row, "question"), _answers(_get(row, "answer")), meta, None


def _bamboogle(row: dict):
    return _get(row, "Question"), _answers(_get(row, "Answer")), {}, None


def _webshaper(row: dict):
    meta = {"formalization": _jsonable(_get(row, "formalization", required=False)),
            "urls": _jsonable(_get(row, "urls", required=False))}
    return _get(row, "question"), _answers(_get(row, "answer")), meta, _get(row, "id", required=False)


def _webwalkerqa(row: dict):
    info = _get(row, "info", required=False)
    if isinstance(info, str):
        info = json.loads(info)
    meta = {"root_url": _get(row, "root_url", required=False), "info": _jsonable(info or {})}
    return _get(row, "question"), _answers(_get(row, "answer")), meta, None


def _simpleqa(row: dict):
    raw = _get(row, "metadata", required=False)
    meta = ast.literal_eval(raw) if isinstance(raw, str) and raw.strip() else (raw or {})  # a Python dict literal
    if not isinstance(meta, dict):
        raise ValueError("metadata is not a dict literal")
    return _get(row, "problem"), _answers(_get(row, "answer")), _jsonable(meta), None


def _frames(row: dict):
    keys = [k for k in row if str(k).startswith("wikipedia_link_")]
    keys.sort(key=lambda k: int("".join(ch for ch in str(k) if ch.isdigit()) or 0))  # 1, 2, ..., 10, 11+
    links = [row[k] for k in keys if row[k]]
    meta = {"reasoning_types": _get(row, "reasoning_types", required=False), "wikipedia_links": links}
    # the upstream TSV names them Prompt / Answer, the common CSV copy question / true_answer
    return _get(row, "Prompt", "question"), _answers(_get(row, "Answer", "true_answer")), meta, None


CONVERTERS: dict[str, Callable[[dict], tuple]] = {
    "deepdive": _deepdive, "sealqa": _sealqa, "bamboogle": _bamboogle, "webshaper": _webshaper,
    "webwalkerqa": _webwalkerqa, "simpleqa": _simpleqa, "frames": _frames,
}


def iter_convert(source: str, path: str, on_error: str = "raise", skips: Optional[SkipCounter] = None,
                 progress: bool = False, split: Optional[str] = None, streaming: bool = False) -> Iterator[QARecord]:
    """Records of one split of `source` at `path`, one at a time (with streaming=True the file is read as
    they are consumed); a bad row raises DataError "<file>:<line>: ..." / "<file> (row N): ..." or is skipped."""
    if source not in CONVERTERS:
        raise DataError(f"unknown source {source!r}; known: {sorted(CONVERTERS)}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    record_split = "test" if source in EVAL_SOURCES else "train"
    single_file = Path(path).is_file()
    rows = iter_rows(path, split, streaming)
    for row in tqdm(rows, desc=f"convert {source}", unit=" rows", disable=not progress):
        try:
            if row.error:
                raise ValueError(row.error)
            question, answers, meta, rid = CONVERTERS[source](row.data)
            if not isinstance(question, str) or not question.strip():
                raise ValueError("empty question")
        except (KeyError, ValueError, SyntaxError, TypeError) as e:
            msg = f"{row.where}: bad {source} row: {str(e).strip(chr(39))}"
            if on_error == "raise":
                raise DataError(msg) from None
            if skips is not None:
                skips.add(msg)
            continue
        digest = hashlib.sha256(question.strip().encode()).hexdigest()[:12]
        rid = f"{source}-{rid}" if rid not in (None, "") else f"{source}-{digest}"
        loc = row.loc if single_file else f"{row.file} {row.loc}"
        yield QARecord(str(rid), question.strip(), answers, source, record_split, dict(meta, location=loc))


def convert_file(source: str, path: str, on_error: str = "raise", skips: Optional[SkipCounter] = None,
                 progress: bool = False, split: Optional[str] = None, streaming: bool = False) -> list[QARecord]:
    """All records of iter_convert as a list."""
    return list(iter_convert(source, path, on_error, skips, progress, split, streaming))


@dataclass
class FilterReport:
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def quality_filter(records: list[QARecord], eval_records: list[QARecord] = (), max_answer_chars: int = 200,
                   report: Optional[FilterReport] = None) -> list[QARecord]:
    """Drop empty or over-long answers, duplicate questions (normalised; first kept), and any training
    question whose normalised form appears in an evaluation set (eval/train overlap)."""
    report = report if report is not None else FilterReport()
    eval_q = {normalize_answer(r.question) for r in eval_records}
    seen: set[str] = set()
    out = []
    for r in records:
        nq = normalize_answer(r.question)
        if not r.answers or not any(a.strip() for a in r.answers):
            report.drop("empty answer")
        elif max(len(a) for a in r.answers) > max_answer_chars:
            report.drop("over-long answer")
        elif nq in eval_q:
            report.drop("overlaps an evaluation question")
        elif nq in seen:
            report.drop("duplicate question")
        else:
            seen.add(nq)
            out.append(r)
    report.kept = len(out)
    return out


def match_scale(synthetic: list[QARecord], target: int, seed: int = 0) -> list[QARecord]:
    """A deterministic sample of `target` synthetic questions (RECIPE 4.1: for controlled comparisons the
    synthetic set is matched to the public mix's scale). Format-augmented copies follow their base
    question so a question and its variants stay together."""
    groups: dict[str, list[QARecord]] = {}
    for r in synthetic:
        groups.setdefault(r.id.removesuffix("-fmt"), []).append(r)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    out: list[QARecord] = []
    for k in keys:
        if len(out) >= target:
            break
        out.extend(groups[k][: target - len(out)])
    if len(out) < target:
        raise DataError(f"match_scale: only {len(synthetic)} synthetic records for a target of {target}; synthesise more")
    return out


def format_augment(records: list[QARecord], instructions: dict[str, str], fraction: float, seed: int = 0) -> list[QARecord]:
    """RECIPE 4.1 augmented prompt format for public sets: each record, plus for a seeded `fraction` a
    copy with an explicit format instruction (`<id>-fmt`, same answers, same split)."""
    rng = random.Random(seed)
    keys = sorted(instructions)
    out = []
    for r in records:
        out.append(r)
        if keys and rng.random() < fraction:
            key = rng.choice(keys)
            out.append(replace(r, id=f"{r.id}-fmt", metadata=dict(r.metadata, format_key=key),
                               format_instruction=instructions[key]))
    return out
