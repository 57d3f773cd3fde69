"""The append-only results file of an eval run: one JSON line per finished (model, set, variant, b, example,
sample); `sample` (eval.samples > 1: the k-th episode of that example) is left out of the key when 0,
so result files written before it existed read unchanged.

Each result is appended and fsync'ed as soon as its example is graded, so an interrupted run
loses at most the examples in flight; a re-run reads the file and asks only what is missing.
A line cut short by a crash (no trailing newline / invalid JSON, only possible as the last line)
is dropped on open: the file is rewritten atomically without it and that example runs again.
Any other invalid line is an error naming file and line.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterator, Optional

from megatron_search.data.jsonl import DataError, atomic_write_text

log = logging.getLogger(__name__)
KEY_FIELDS = ("model", "benchmark", "variant", "budget", "id")


def result_key(model: str, benchmark: str, variant: str, budget: Optional[int], example_id: str,
               sample: int = 0) -> str:
    fields = [model, benchmark, variant, budget, example_id] + ([sample] if sample else [])
    return json.dumps(fields, ensure_ascii=False)


def row_key(row: dict) -> str:
    return result_key(*(row[k] for k in KEY_FIELDS), row.get("sample", 0))


class ResultStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._rows: dict[str, dict] = {}
        if self.path.is_file():
            self._load()

    def _load(self) -> None:
        raw = self.path.read_text(encoding="utf-8")
        lines = raw.split("\n")
        complete, tail = lines[:-1], lines[-1]  # tail is "" when the file ends with a newline
        dropped = bool(tail.strip())
        for lineno, line in enumerate(complete, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                key = row_key(row)
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(f"{self.path}:{lineno}: not an eval result line ({e})") from None
            self._rows[key] = row
        if dropped:
            log.warning("%s: dropping a partial last line left by an interrupted run (that example runs again)",
                        self.path)
            atomic_write_text(self.path, "".join(l + "\n" for l in complete if l.strip()))

    def __contains__(self, key: str) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, row: dict) -> None:
        """Append one result (durably) and index it; a key already present is an error (no double counting)."""
        key = row_key(row)
        if key in self._rows:
            raise ValueError(f"{self.path}: result {key} is already recorded")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(row, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self._rows[key] = row

    def rows(self, **match) -> Iterator[dict]:
        """Results whose fields equal every `match` item (e.g. model="m", variant="budget")."""
        for row in self._rows.values():
            if all(row.get(k) == v for k, v in match.items()):
                yield row
