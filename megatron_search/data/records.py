"""The common record schema every QA source is converted to (synthetic and public alike).

A row is `id, question, answers, source, metadata, split`; synthetic rows add `hops` and `chain`,
and format-augmented rows add `format_instruction` (the answer stays the same).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

from .hf_datasets import iter_rows
from .jsonl import DataError

SPLITS = ("train", "validation", "test")


@dataclass
class QARecord:
    id: str
    question: str
    answers: list[str]
    source: str
    split: str = "train"
    metadata: dict[str, Any] = field(default_factory=dict)
    hops: Optional[int] = None
    chain: Optional[list[dict]] = None
    format_instruction: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.answers, list) or not all(isinstance(a, str) for a in self.answers):
            raise DataError(f"record {self.id}: answers must be a list of strings, got {self.answers!r}")
        if self.split not in SPLITS:
            raise DataError(f"record {self.id}: split must be one of {SPLITS}, got {self.split!r}")

    @property
    def prompt(self) -> str:
        """The question in the augmented prompt format (format instruction appended when present)."""
        if self.format_instruction:
            return f"{self.question}\n\n{self.format_instruction}"
        return self.question

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("hops", "chain", "format_instruction"):
            if d[k] is None:
                del d[k]
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "") -> "QARecord":
        missing = [k for k in ("id", "question", "answers", "source") if k not in d]
        if missing:
            raise DataError(f"{where}: missing field(s) {missing}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise DataError(f"{where}: unknown field(s) {sorted(unknown)}")
        return cls(**d)


def read_records(path, split: Optional[str] = None, streaming: bool = False) -> Iterator[QARecord]:
    """QA records of one split of a file or folder (JSONL, parquet, Arrow, a Hub-layout or save_to_disk
    folder) read through `datasets` (data/hf_datasets.py); `split` is the dataset split, not the records'
    `split` field. A bad row is a DataError naming file:line (JSONL) or file (row N)."""
    for _, rec in read_records_where(path, split, streaming):
        yield rec


def read_records_where(path, split: Optional[str] = None, streaming: bool = False) -> Iterator[tuple[str, QARecord]]:
    """(where, record) pairs of read_records, where = "file:line" or "file (row N)" for later errors."""
    for row in iter_rows(path, split, streaming):
        if row.error:
            raise DataError(f"{row.where}: {row.error}")
        yield row.where, QARecord.from_dict(_drop_absent(row.data), row.where)


def _drop_absent(d: dict) -> dict:
    """A row's optional top-level fields that are None left out: in Arrow a column some rows fill is None
    in the others, and from_dict should see the record a JSONL line without those fields gives."""
    return {k: v for k, v in d.items() if not (v is None and k in _OPTIONAL)}


_OPTIONAL = ("hops", "chain", "format_instruction", "metadata")
