"""Preference pairs (RECIPE 5.1): the JSONL format, checks, converters, the label-noise filter.

One pair per line:
    {"context": [chat messages] | "user text", "answer_a": str, "answer_b": str,
     "label": 1 if answer_a is preferred else 0, "source": "where the pair came from",
     "votes": {"<scoring model>": 0|1, ...}}          (optional; used by the noise filter)
Bad pairs (identical answers, missing or mistyped fields, labels outside {0, 1}) either stop the
read with an error naming file:line (on_bad="error") or are skipped and counted per reason
(on_bad="skip"); nothing is silently repaired. Files are read through Hugging Face `datasets`
(data/hf_datasets.py): JSONL, parquet, Arrow, or a folder in the Hub's layout / save_to_disk, eagerly
or streamed; rows of Arrow formats are named file (row N).

Converters turn common open "chosen/rejected" records into pairs; the presentation order is
drawn from a seeded hash of the record so the labels are balanced and reproducible.

Label-noise filter (RECIPE 5.1, Datbench-inspired): keep a pair only when at least
`min_models` scoring models judged it and at least `threshold` of them agree with its label.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Optional, Sequence

from megatron_search.data.hf_datasets import iter_rows
from megatron_search.data.jsonl import write_jsonl

OnBad = Literal["error", "skip"]


class PreferenceDataError(ValueError):
    """A preference pair is malformed (the message names file:line and the field)."""


@dataclass(frozen=True)
class PreferencePair:
    context: tuple  # chat messages (dicts with role/content), frozen as a tuple
    answer_a: str
    answer_b: str
    label: int  # 1: answer_a preferred, 0: answer_b preferred
    source: str = ""
    votes: dict = field(default_factory=dict, compare=False)

    @property
    def messages(self) -> list[dict]:
        return [dict(m) for m in self.context]

    def swapped(self) -> "PreferencePair":
        votes = {k: 1 - v for k, v in self.votes.items()}
        return PreferencePair(self.context, self.answer_b, self.answer_a, 1 - self.label, self.source, votes)

    def to_json(self) -> dict:
        d = asdict(self)
        d["context"] = self.messages
        if not d["votes"]:
            del d["votes"]
        return d


@dataclass
class ReadStats:
    read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count

    def summary(self) -> str:
        why = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items()))
        return f"{self.kept}/{self.read} pairs kept" + (f" (skipped {why})" if why else "")


def _context(value: Any, where: str) -> tuple:
    if isinstance(value, str):
        if not value.strip():
            raise PreferenceDataError(f"{where}: 'context' is empty")
        return ({"role": "user", "content": value},)
    if isinstance(value, list) and value:
        out = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise PreferenceDataError(f"{where}: context[{i}] is not a {{'role': str, 'content': str}} message")
            out.append({"role": m["role"], "content": m["content"]})
        return tuple(out)
    raise PreferenceDataError(f"{where}: 'context' must be a non-empty string or list of chat messages")


def pair_from_record(rec: Any, where: str) -> PreferencePair:
    """Validate one JSON record; raises PreferenceDataError naming `where` and the problem."""
    if not isinstance(rec, dict):
        raise PreferenceDataError(f"{where}: a pair must be a JSON object")
    missing = [k for k in ("context", "answer_a", "answer_b", "label") if k not in rec]
    if missing:
        raise PreferenceDataError(f"{where}: missing field(s) {', '.join(missing)}")
    for k in ("answer_a", "answer_b"):
        if not isinstance(rec[k], str):
            raise PreferenceDataError(f"{where}: '{k}' must be a string")
    label = rec["label"]
    if isinstance(label, bool) or label not in (0, 1):
        raise PreferenceDataError(f"{where}: 'label' must be 0 or 1, got {label!r}")
    if rec["answer_a"].strip() == rec["answer_b"].strip():
        raise PreferenceDataError(f"{where}: answer_a and answer_b are identical (no preference to learn)")
    votes = rec.get("votes") or {}
    if not isinstance(votes, dict) or any(v not in (0, 1) or isinstance(v, bool) for v in votes.values()):
        raise PreferenceDataError(f"{where}: 'votes' must map model names to 0 or 1")
    source = rec.get("source", "")
    if not isinstance(source, str):
        raise PreferenceDataError(f"{where}: 'source' must be a string")
    return PreferencePair(_context(rec["context"], where), rec["answer_a"], rec["answer_b"], int(label), source,
                          dict(votes))


def _reason(err: PreferenceDataError) -> str:
    msg = str(err).split(": ", 1)[-1]
    for key in ("identical", "missing", "label", "JSON", "context", "votes", "answer", "source"):
        if key in msg:
            return key.lower()
    return "other"


def _records(path: str | Path, split: Optional[str], streaming: bool, stats: ReadStats) -> Iterator[tuple[str, Any]]:
    """(where, record or PreferenceDataError) for every row; counts rows read."""
    for row in iter_rows(path, split, streaming):
        stats.read += 1
        yield row.where, (PreferenceDataError(f"{row.where}: {row.error}") if row.error else row.data)


def read_pairs(path: str | Path, on_bad: OnBad = "error", stats: Optional[ReadStats] = None,
               split: Optional[str] = None, streaming: bool = False) -> list[PreferencePair]:
    """All valid pairs of one split of a file or folder (see the module docstring for on_bad)."""
    stats = stats if stats is not None else ReadStats()
    out = []
    for where, rec in _records(path, split, streaming, stats):
        try:
            if isinstance(rec, PreferenceDataError):
                raise rec
            out.append(pair_from_record(rec, where))
        except PreferenceDataError as e:
            if on_bad == "error":
                raise
            stats.skipped[_reason(e)] += 1
    stats.kept = len(out)
    return out


def write_pairs(path: str | Path, pairs: Iterable[PreferencePair]) -> int:
    """Write pairs as JSONL atomically (temp file + rename); returns the count."""
    return write_jsonl(Path(path), (p.to_json() for p in pairs))


# ---------------------------------------------------------------------------------- converters
def _stable_bit(*parts: str, seed: int = 0) -> int:
    h = hashlib.sha256("\x1f".join((str(seed),) + parts).encode("utf-8")).digest()
    return h[0] & 1


_HUMAN, _ASSISTANT = "\n\nHuman:", "\n\nAssistant:"


def _split_dialogue(text: str) -> list[dict]:
    """'\\n\\nHuman: ..\\n\\nAssistant: ..' transcripts (HH-RLHF style) -> chat messages."""
    msgs = []
    marks = sorted([(i, "user") for i in _find_all(text, _HUMAN)] + [(i, "assistant") for i in _find_all(text, _ASSISTANT)])
    for n, (i, role) in enumerate(marks):
        start = i + len(_HUMAN if role == "user" else _ASSISTANT)
        end = marks[n + 1][0] if n + 1 < len(marks) else len(text)
        msgs.append({"role": role, "content": text[start:end].strip()})
    return msgs


def _find_all(text: str, needle: str) -> list[int]:
    out, i = [], text.find(needle)
    while i >= 0:
        out.append(i)
        i = text.find(needle, i + 1)
    return out


def _conversation_and_answer(value: Any, where: str, name: str) -> tuple[Optional[list[dict]], str]:
    """(context messages or None, final assistant answer) of a chosen/rejected field."""
    if isinstance(value, list):
        if not value or not isinstance(value[-1], dict) or value[-1].get("role") != "assistant":
            raise PreferenceDataError(f"{where}: '{name}' must end with an assistant message")
        return [dict(role=m["role"], content=m["content"]) for m in value[:-1]], str(value[-1].get("content", ""))
    if isinstance(value, str):
        if _ASSISTANT in value:
            msgs = _split_dialogue(value)
            if not msgs or msgs[-1]["role"] != "assistant":
                raise PreferenceDataError(f"{where}: '{name}' does not end with an Assistant turn")
            return msgs[:-1], msgs[-1]["content"]
        return None, value
    raise PreferenceDataError(f"{where}: '{name}' must be a string or a list of chat messages")


def convert_chosen_rejected(rec: Any, where: str, source: str, seed: int = 0) -> PreferencePair:
    """One chosen/rejected record -> a pair. Accepted shapes:
    {"prompt": str | messages, "chosen": str, "rejected": str};
    {"chosen": messages, "rejected": messages} (last message = the answer, the rest = context);
    {"chosen": "\\n\\nHuman: ..\\n\\nAssistant: ..", "rejected": ...} (HH-RLHF transcripts)."""
    if not isinstance(rec, dict) or "chosen" not in rec or "rejected" not in rec:
        raise PreferenceDataError(f"{where}: missing field(s) chosen/rejected")
    ctx_c, chosen = _conversation_and_answer(rec["chosen"], where, "chosen")
    ctx_r, rejected = _conversation_and_answer(rec["rejected"], where, "rejected")
    if "prompt" in rec:
        context: Any = rec["prompt"]
    elif ctx_c:
        if ctx_r is not None and ctx_r != ctx_c:
            raise PreferenceDataError(f"{where}: chosen and rejected have different conversations before the answer")
        context = ctx_c
    else:
        raise PreferenceDataError(f"{where}: missing field(s) prompt (and no conversation before the answers)")
    chosen_first = _stable_bit(chosen, rejected, seed=seed) == 1
    a, b = (chosen, rejected) if chosen_first else (rejected, chosen)
    return pair_from_record({"context": context, "answer_a": a, "answer_b": b, "label": int(chosen_first),
                             "source": source}, where)


def convert_file(path: str | Path, source: str, on_bad: OnBad = "error", seed: int = 0,
                 stats: Optional[ReadStats] = None, split: Optional[str] = None,
                 streaming: bool = False) -> list[PreferencePair]:
    """Chosen/rejected records of one split of a file or folder -> pairs (bad records: error or counted skip)."""
    stats = stats if stats is not None else ReadStats()
    out = []
    for where, rec in _records(path, split, streaming, stats):
        try:
            if isinstance(rec, PreferenceDataError):
                raise rec
            out.append(convert_chosen_rejected(rec, where, source, seed))
        except PreferenceDataError as e:
            if on_bad == "error":
                raise
            stats.skipped[_reason(e)] += 1
    stats.kept = len(out)
    return out


# ---------------------------------------------------------------------------------- noise filter
def with_votes(pairs: Sequence[PreferencePair], model: str, p_bar: Sequence[float]) -> list[PreferencePair]:
    """Record a scoring model's judgement (vote 1 when P_bar(answer_a beats answer_b) > 1/2)."""
    if len(p_bar) != len(pairs):
        raise ValueError(f"with_votes: {len(p_bar)} scores for {len(pairs)} pairs")
    out = []
    for p, s in zip(pairs, p_bar):
        votes = dict(p.votes)
        votes[model] = int(float(s) > 0.5)
        out.append(PreferencePair(p.context, p.answer_a, p.answer_b, p.label, p.source, votes))
    return out


def agreement(pair: PreferencePair) -> float:
    """Fraction of the recorded votes that agree with the pair's label (0 with no votes)."""
    if not pair.votes:
        return 0.0
    return sum(int(v == pair.label) for v in pair.votes.values()) / len(pair.votes)


def filter_by_agreement(pairs: Sequence[PreferencePair], threshold: float, min_models: int,
                        stats: Optional[ReadStats] = None) -> list[PreferencePair]:
    """Keep pairs judged by >= min_models scoring models of which >= threshold agree with the label."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"agreement threshold must lie in [0, 1], got {threshold}")
    stats = stats if stats is not None else ReadStats()
    out = []
    for p in pairs:
        stats.read += 1
        if len(p.votes) < min_models:
            stats.skipped["too few votes"] += 1
        elif agreement(p) < threshold:
            stats.skipped["models disagree with label"] += 1
        else:
            out.append(p)
    stats.kept = len(out)
    return out


def iter_batches(items: Sequence, size: int) -> Iterator[Sequence]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
