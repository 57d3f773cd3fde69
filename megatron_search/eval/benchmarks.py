"""Evaluation sets: SimpleQA (CSV), FRAMES (TSV or CSV copy), FACTS-style JSONL and converted QA sets, one schema.

Every loader returns `EvalExample`s (id, question, gold answers, benchmark, metadata). Layouts
(FACTS.md): SimpleQA `metadata,problem,answer`; FRAMES `Prompt, Answer, wikipedia_link_1..,
reasoning_types, wiki_links` (both through data/public.py's converters, so eval and the train/eval
overlap filter read them identically). FRAMES also comes as a widespread CSV copy whose question and answer
columns are `question` / `true_answer` (the rest as upstream): the layout is told by the header, not the file
suffix; that copy's rows are renamed to the upstream columns and go through the same row converter and id rule
(ids are frames-<sha256(question)[:12]> in both, so results on file carry over), while any other header is an
error naming the file and the columns found. converted sets are the common QARecord JSONL (data/records.py),
optionally filtered to one split. "Facts Open" is most likely the public split of FACTS Search
(not confirmed, FACTS.md), so its loader accepts the usual field names of such JSONL files:
question in `question`/`prompt`/`user_request`/`problem`, gold in `answers`/`answer`/
`gold_answer`/`ground_truth`.

`subsample(examples, limit, seed)` keeps the `limit` examples with the smallest sha256(seed:id):
deterministic, independent of file order, and nested (a larger limit keeps every smaller one's
examples), so partial runs at different limits share their results. The original order is kept.

Every set is read through Hugging Face `datasets` (data/hf_datasets.py), offline: a path is a file, a
folder in the Hub's layout (e.g. data/test-00000-of-00001.parquet) or a save_to_disk folder; `split`
names a folder's split (default: its only one). For converted record sets `split` also keeps the
records whose own `split` field matches (a folder without that split is read whole, then filtered).
The sets are small, so each is read whole into memory.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_search.data.hf_datasets import column_names, iter_rows, missing_path_error, splits
from megatron_search.data.jsonl import DataError, atomic_write_text
from megatron_search.data.public import CONVERTERS, convert_file
from megatron_search.data.records import QARecord, read_records_where

KINDS = ("simpleqa", "frames", "facts", "records")
_FACTS_QUESTION = ("question", "prompt", "user_request", "problem")
_FACTS_ANSWER = ("answers", "answer", "gold_answer", "ground_truth")
# FRAMES layouts, told apart by their question/answer columns (matched case-insensitively)
FRAMES_LAYOUTS = {"upstream": ("Prompt", "Answer"), "csv_copy": ("question", "true_answer")}
_CSV_COPY_TO_UPSTREAM = {"question": "Prompt", "true_answer": "Answer"}


@dataclass(frozen=True)
class EvalExample:
    id: str
    question: str
    answers: tuple[str, ...]
    benchmark: str
    metadata: dict = field(default_factory=dict, compare=False, hash=False)

    def to_dict(self) -> dict:
        return {"id": self.id, "question": self.question, "answers": list(self.answers), "benchmark": self.benchmark}


def _from_record(r: QARecord, benchmark: str, where: str) -> EvalExample:
    if not r.answers:
        raise DataError(f"{where}: example {r.id!r} has no gold answer")
    return EvalExample(r.id, r.prompt, tuple(r.answers), benchmark, dict(r.metadata))


def _unique(examples: list[EvalExample], path) -> list[EvalExample]:
    seen: set[str] = set()
    for e in examples:
        if e.id in seen:
            raise DataError(f"{path}: duplicate example id {e.id!r} (results are keyed by id)")
        seen.add(e.id)
    return examples


def load_simpleqa(path: str | Path, split: Optional[str] = None) -> list[EvalExample]:
    return _unique([_from_record(r, "simpleqa", str(path)) for r in convert_file("simpleqa", str(path), split=split)], path)


def frames_layout(path: str | Path, split: Optional[str] = None) -> str:
    """"upstream" (Prompt / Answer) or "csv_copy" (question / true_answer), from the header (or the
    Arrow columns); else DataError."""
    cols = column_names(path, split)
    have = {c.strip().lower() for c in cols}
    found = [name for name, need in FRAMES_LAYOUTS.items() if {n.lower() for n in need} <= have]
    if len(found) == 1:
        return found[0]
    want = " or ".join(f"{' + '.join(need)} ({name})" for name, need in FRAMES_LAYOUTS.items())
    why = "has the columns of both layouts" if found else "has neither layout's question/answer columns"
    raise DataError(f"{path}: not a FRAMES file this loader reads: its header {why}; expected {want}, "
                    f"case-insensitive; columns found: {cols}")


def _frames_csv_copy(path: str | Path, split: Optional[str]) -> list[EvalExample]:
    """The CSV copy, row by row through data/public.py's FRAMES converter after renaming its two columns."""
    out = []
    single_file = Path(path).is_file()
    for row in iter_rows(path, split):
        where, loc = row.where, (row.loc if single_file else f"{row.file} {row.loc}")
        try:
            if row.error:
                raise ValueError(row.error)
            renamed = {_CSV_COPY_TO_UPSTREAM.get(str(k).lstrip("\ufeff").strip().lower(), k): v for k, v in row.data.items()}
            question, answers, meta, _ = CONVERTERS["frames"](renamed)
            if not isinstance(question, str) or not question.strip():
                raise ValueError("empty question")
        except (KeyError, ValueError, TypeError) as e:
            raise DataError(f"{where}: bad frames row: {str(e).strip(chr(39))}") from None
        rid = "frames-" + hashlib.sha256(question.strip().encode()).hexdigest()[:12]  # convert_file's id rule
        if not answers:
            raise DataError(f"{where}: example {rid!r} has no gold answer")
        out.append(EvalExample(rid, question.strip(), tuple(answers), "frames", dict(meta, location=loc)))
    return out


def load_frames(path: str | Path, split: Optional[str] = None) -> list[EvalExample]:
    """FRAMES in either layout (module docstring)."""
    if frames_layout(path, split) == "csv_copy":
        return _unique(_frames_csv_copy(path, split), path)
    return _unique([_from_record(r, "frames", str(path)) for r in convert_file("frames", str(path), split=split)], path)


def _first(row: dict, names: tuple[str, ...]):
    lower = {str(k).lower(): v for k, v in row.items()}
    for n in names:
        if lower.get(n) not in (None, "", []):
            return lower[n]
    return None


def load_facts(path: str | Path, split: Optional[str] = None) -> list[EvalExample]:
    """FACTS-style rows (see module docstring); ids default to facts-<n>, n the row's 1-based position."""
    out = []
    for n, row in enumerate(iter_rows(path, split), 1):
        if row.error:
            raise DataError(f"{row.where}: {row.error}")
        where = f"{row.where}: row {n}" if row.unit == "line" else f"{row.file}: row {n}"
        q, a = _first(row.data, _FACTS_QUESTION), _first(row.data, _FACTS_ANSWER)
        if not isinstance(q, str) or not q.strip():
            raise DataError(f"{where}: no question (one of {list(_FACTS_QUESTION)})")
        answers = [a] if isinstance(a, str) else a
        if not isinstance(answers, list) or not answers or not all(isinstance(x, str) and x.strip() for x in answers):
            raise DataError(f"{where}: gold answer must be a non-empty string or list of strings "
                            f"(one of {list(_FACTS_ANSWER)})")
        rid = row.data.get("id")
        rid = str(rid) if rid is not None else f"facts-{n}"
        meta = {k: v for k, v in row.data.items() if k.lower() not in _FACTS_QUESTION + _FACTS_ANSWER + ("id",)}
        out.append(EvalExample(rid, q.strip(), tuple(x.strip() for x in answers), "facts", meta))
    return _unique(out, path)


def load_records(path: str | Path, split: Optional[str] = None, benchmark: Optional[str] = None) -> list[EvalExample]:
    """A converted QA set (QARecord rows, e.g. the embedded demo's qa.jsonl); `split` keeps one split
    (and picks a folder's split of that name when it has one)."""
    ds_split = split if Path(path).is_dir() and split in splits(path) else None
    out = []
    for where, rec in read_records_where(path, ds_split):
        if split is None or rec.split == split:
            out.append(_from_record(rec, benchmark or rec.source, where))
    if not out:
        raise DataError(f"{path}: no examples" + (f" in split {split!r}" if split else ""))
    return _unique(out, path)


def subsample(examples: list[EvalExample], limit: int, seed: int = 0) -> list[EvalExample]:
    """The deterministic sub-sample described in the module docstring (limit 0 = all)."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if not limit or limit >= len(examples):
        return list(examples)
    rank = {e.id: hashlib.sha256(f"{seed}:{e.id}".encode()).hexdigest() for e in examples}
    keep = set(sorted(rank, key=rank.get)[:limit])
    return [e for e in examples if e.id in keep]


def load_benchmark(kind: str, path: str | Path, limit: int = 0, seed: int = 0, split: Optional[str] = None,
                   name: Optional[str] = None) -> list[EvalExample]:
    """One of KINDS from `path`, sub-sampled to `limit`. `name` relabels the benchmark (default: the kind)."""
    if kind not in KINDS:
        raise DataError(f"unknown benchmark kind {kind!r}; known: {list(KINDS)}")
    if not Path(path).exists():
        raise DataError(f"benchmark {kind}: {missing_path_error(str(path))}")
    if kind == "records":
        examples = load_records(path, split, name)
    else:
        if split is not None and not Path(path).is_dir():
            raise DataError(f"benchmark {kind}: a split applies only to converted record sets and to folders "
                            f"with named splits; {path} is one file")
        examples = {"simpleqa": load_simpleqa, "frames": load_frames, "facts": load_facts}[kind](path, split)
    if name is not None:
        examples = [EvalExample(e.id, e.question, e.answers, name, e.metadata) for e in examples]
    return subsample(examples, limit, seed)


def write_examples(path: str | Path, examples: list[EvalExample]) -> None:
    """Examples as JSONL (the set a run evaluated, kept beside its results)."""
    atomic_write_text(path, "".join(json.dumps(e.to_dict(), ensure_ascii=False) + "\n" for e in examples))
