"""JSONL reading and atomic writing shared by every data stage.

Reading reports bad lines with file and line number (or skips and counts them); writing goes to a
temporary file in the same directory and is moved into place with os.replace, so a crash never
leaves a half-written output behind.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator


class DataError(ValueError):
    """Bad input data; the message names the file and line."""


@dataclass
class SkipCounter:
    """Counts rows skipped by a lenient reader, with the first few reasons kept for the log."""

    skipped: int = 0
    reasons: list[str] = field(default_factory=list)
    keep: int = 20

    def add(self, reason: str) -> None:
        self.skipped += 1
        if len(self.reasons) < self.keep:
            self.reasons.append(reason)


def read_jsonl(path: str | os.PathLike, on_error: str = "raise", skips: SkipCounter | None = None) -> Iterator[dict]:
    """Yield one dict per non-empty line. on_error: "raise" (DataError naming file:line) or "skip"."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            except ValueError as e:
                msg = f"{path}:{lineno}: invalid JSONL row: {e}"
                if on_error == "raise":
                    raise DataError(msg) from None
                if skips is not None:
                    skips.add(msg)
                continue
            yield row


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_jsonl(path: str | os.PathLike, rows: Iterable[Any]) -> int:
    """Write rows (dicts or objects with to_dict) atomically; returns the row count."""
    lines = []
    for row in rows:
        d = row.to_dict() if hasattr(row, "to_dict") else row
        lines.append(json.dumps(d, ensure_ascii=False, sort_keys=False))
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return len(lines)


def append_jsonl(path: str | os.PathLike, row: Any) -> None:
    """Append one row as a line (a log that grows as a run goes; flushed at once)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, ensure_ascii=False, indent=1) + "\n")
