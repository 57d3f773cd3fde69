"""Row readers for the public dataset file formats: JSONL/JSON, CSV/TSV and parquet.

Each row comes with its location ("line 12" for text formats, the line where the CSV record starts;
"row 12" for parquet, 1-based), so converters can name file and line in every error.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import Iterator

from .jsonl import DataError

Row = tuple[str, dict]  # (location, row)


def read_rows(path: str | os.PathLike) -> Iterator[Row]:
    """Rows of a .jsonl/.json/.csv/.tsv/.parquet file, with their location."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet(p)
    elif suffix in (".csv", ".tsv"):
        yield from _delimited(p, "\t" if suffix == ".tsv" else ",")
    elif suffix == ".jsonl":
        yield from _jsonl(p)
    elif suffix == ".json":
        data = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise DataError(f"{p}: expected a JSON list of objects")
        for i, row in enumerate(data, 1):
            yield f"item {i}", row
    else:
        raise DataError(f"{p}: unknown file type {suffix!r} (expected .jsonl, .json, .csv, .tsv or .parquet)")


def _jsonl(p: Path) -> Iterator[Row]:
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield f"line {lineno}", {"__error__": f"not valid JSON ({e.msg})"}
                continue
            yield f"line {lineno}", row if isinstance(row, dict) else {"__error__": "not a JSON object"}


def _delimited(p: Path, delimiter: str) -> Iterator[Row]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # FRAMES/SealQA cells can be long
    with open(p, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter=delimiter)
        header = next(reader, None)
        if header is None:
            return
        start = reader.line_num + 1
        for cells in reader:
            loc = f"line {start}"
            start = reader.line_num + 1
            if not any(c.strip() for c in cells):
                continue
            if len(cells) != len(header):
                yield loc, {"__error__": f"{len(cells)} fields, header has {len(header)}"}
                continue
            yield loc, dict(zip(header, cells))


def _parquet(p: Path) -> Iterator[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow is an install requirement
        raise DataError(f"{p}: reading parquet needs pyarrow (pip install pyarrow)") from e
    # stream record batches: multi-GB files never sit in memory as Python objects at once
    i = 0
    for batch in pq.ParquetFile(p).iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            i += 1
            yield f"row {i}", row
