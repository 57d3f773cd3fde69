"""The common record schema every QA source is converted to (synthetic and public alike).

A row is `id, question, answers, source, metadata, split`; synthetic rows add `hops` and `chain`,
and format-augmented rows add `format_instruction` (the answer stays the same).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

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
