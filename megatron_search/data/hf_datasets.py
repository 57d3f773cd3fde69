"""Every user dataset path read through Hugging Face `datasets`, offline, with file:line checks on top.

A path is a local file (.jsonl / .json / .csv / .tsv / .parquet / .arrow), a folder saved with
`Dataset.save_to_disk` / `DatasetDict.save_to_disk` (memory-mapped Arrow, read in place), or a folder
in the Hub's layout (`data/<split>-00000-of-00001.parquet`, `<split>.jsonl`, `train/*.csv`, ...; the
split names and files are the ones `datasets` itself infers for that folder, from its default config).
Nothing is downloaded: `datasets` runs with its offline flags set, and a path that is not a local file
or folder (a Hub id such as "user/name" included) is a DataError before `datasets` is asked.

Two ways to read a split (`split=None`: the only one; several: name one):
- eager (default): `datasets.load_dataset` builds a memory-mapped Arrow copy in the datasets cache
  (HF_DATASETS_CACHE; rebuilt when the file's size, mtime, ctime or inode change: the cache is keyed on
  more than `datasets`' own mtime so a file rewritten within one timestamp tick is never served stale);
  `row_table()` then gives random access without holding the rows in memory;
- streaming (`streaming=True`): an `IterableDataset` read from the file as rows are consumed, no copy,
  for sets larger than memory or disk.
Both yield the same rows in the same order (tests/test_data_hf_datasets.py).

Text formats are read through `datasets`' "text" builder (one Arrow row per line, blank lines kept, so
row i is line i + 1) and parsed here: JSON lines with `json.loads`, CSV/TSV with the `csv` module over
those lines. That keeps what the readers check and the values exact: errors name file:line, a CSV
record with the wrong number of fields is caught with its line, cells stay the strings written
(datasets' own json/csv builders unify rows into one Arrow schema, adding None for keys a row lacks,
and read CSV through pandas, which turns "NA" or "None" cells into nulls and pads short records).
Parquet / Arrow files and saved folders are read by `datasets` as Arrow; their rows are named by row
index (1-based), and a key absent from a row comes back as None (Arrow stores one schema per set).
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from .jsonl import DataError

TEXT_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv")
ARROW_SUFFIXES = (".parquet", ".arrow")
SUFFIXES = TEXT_SUFFIXES + ARROW_SUFFIXES
_BATCH = 4096


@dataclass(frozen=True)
class Row:
    """One row of a dataset file: its data, or why it could not be read, and where it is.

    unit is "line" (text formats: the line where the row starts), "item" (a .json list) or "row"
    (Arrow formats and saved folders; 1-based)."""

    file: str
    unit: str
    index: int
    data: Optional[dict]
    error: Optional[str] = None

    @property
    def loc(self) -> str:
        return f"{self.unit} {self.index}"

    @property
    def where(self) -> str:
        """"file:12" for a line, "file (row 12)" otherwise: what every error message starts with."""
        return f"{self.file}:{self.index}" if self.unit == "line" else f"{self.file} ({self.loc})"


# ------------------------------------------------------------------------------ datasets, offline
def _datasets():
    """`datasets`, imported on first use with its offline switches on and its progress bars off
    (the readers show their own). Only datasets' own flags are set, not the process-wide Hub ones,
    so other libraries in the process keep their settings."""
    try:
        import datasets  # start-up: datasets (0.8 s), only for Hub/Arrow/parquet paths; JSONL data commands skip it
    except ImportError as e:  # pragma: no cover - an install requirement
        raise DataError("reading datasets needs Hugging Face `datasets` (pip install 'datasets>=4.0')") from e
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if hasattr(datasets.config, flag):
            setattr(datasets.config, flag, True)
    datasets.disable_progress_bars()
    return datasets


def missing_path_error(path: str) -> DataError:
    """The error for a path that is neither a local file nor a local folder (with a hint for Hub ids)."""
    hint = ""
    s = str(path)
    if s.count("/") == 1 and not s.startswith((".", "/", "~")) and not Path(s).suffix:
        hint = (f"; {s!r} looks like a Hub dataset id, and nothing is downloaded here: download it first "
                f"(hf download {s} --repo-type dataset --local-dir DIR) and pass DIR")
    return DataError(f"no file or folder {path} (datasets are read from local paths only){hint}")


def _cache_name(file: Path) -> str:
    """A builder config name that changes whenever the file may have changed (see the module docstring)."""
    st = file.stat()
    key = f"{file.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}|{st.st_dev}"
    return "ms-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _load_file(builder: str, file: Path, streaming: bool, **kwargs):
    """One local file as a `datasets` split: Dataset (memory-mapped) or IterableDataset (streaming)."""
    ds = _datasets()
    name = None if streaming else _cache_name(file)
    return ds.load_dataset(builder, name=name, data_files=[str(file)], split="train", streaming=streaming,
                           **kwargs)


# ------------------------------------------------------------------------------ what a path is
@dataclass(frozen=True)
class _Part:
    """A piece of a split: one file, or one saved split (a save_to_disk folder)."""

    path: Path
    label: str  # how errors name it
    saved: bool = False


def _is_saved(p: Path) -> bool:
    return (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file())


def _check_file(p: Path) -> None:
    if p.suffix.lower() not in SUFFIXES:
        raise DataError(f"{p}: unknown file type {p.suffix.lower() or '(none)'!r} "
                        f"(expected one of {', '.join(SUFFIXES)}, or a folder in the Hub's layout / save_to_disk)")


def _folder_splits(p: Path) -> dict[str, list[_Part]]:
    """{split: parts} of a folder: saved splits, or the data files `datasets` infers for its default config."""
    if (p / "dataset_dict.json").is_file():
        names = json.loads((p / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
        return {n: [_Part(p / n, str(p / n), saved=True)] for n in names}
    if _is_saved(p):
        split = json.loads((p / "dataset_info.json").read_text(encoding="utf-8")).get("split") or "train"
        return {str(split): [_Part(p, str(p), saved=True)]}
    ds = _datasets()
    try:
        builder = ds.load_dataset_builder(str(p))
    except Exception as e:  # EmptyDatasetError, DataFilesNotFoundError, ...: nothing datasets can read there
        raise DataError(f"{p}: not a dataset folder datasets can read ({type(e).__name__}: {e}); expected data "
                        f"files such as data/train-00000-of-00001.parquet or train.jsonl, or a save_to_disk folder") from None
    out: dict[str, list[_Part]] = {}
    for split, files in (builder.config.data_files or {}).items():
        parts = []
        for f in files:
            fp = Path(str(f))
            _check_file(fp)
            try:
                label = str(p / fp.relative_to(p.resolve()))
            except ValueError:
                label = str(fp)
            parts.append(_Part(fp, label))
        out[str(split)] = parts
    if not out:
        raise DataError(f"{p}: no data files found")
    return out


def splits(path: str | os.PathLike) -> list[str]:
    """The split names of a path (a single file has one, "train", as `datasets` names it)."""
    p = Path(path)
    if p.is_file():
        _check_file(p)
        return ["train"]
    if p.is_dir():
        return sorted(_folder_splits(p))
    raise missing_path_error(str(path))


def _parts(path: str | os.PathLike, split: Optional[str]) -> list[_Part]:
    p = Path(path)
    if p.is_file():
        _check_file(p)
        if split not in (None, "train"):
            raise DataError(f"{path}: a single file has one split ('train'), not {split!r}; pass a folder for named splits")
        return [_Part(p, str(path))]
    if not p.is_dir():
        raise missing_path_error(str(path))
    found = _folder_splits(p)
    if split is None:
        if len(found) != 1:
            raise DataError(f"{path}: has splits {sorted(found)}; name the one to read (split=...)")
        return next(iter(found.values()))
    if split not in found:
        raise DataError(f"{path}: no split {split!r} (has {sorted(found)})")
    return found[split]


# ------------------------------------------------------------------------------ rows
def _arrow_split(part: _Part, streaming: bool):
    ds = _datasets()
    if part.saved:
        d = ds.load_from_disk(str(part.path))  # one saved split: _folder_splits names DatasetDict splits apart
        return d.to_iterable_dataset() if streaming else d
    builder = "parquet" if part.path.suffix.lower() == ".parquet" else "arrow"
    return _load_file(builder, part.path, streaming)


def _batches(d) -> Iterator[dict]:
    """Column batches of a Dataset or IterableDataset, in order."""
    yield from d.iter(batch_size=_BATCH)


def _lines(part: _Part, streaming: bool, keep_linebreaks: bool = False) -> Iterator[str]:
    d = _load_file("text", part.path, streaming, keep_linebreaks=keep_linebreaks)
    for batch in _batches(d):
        yield from batch["text"]


def _json_row(text: str) -> tuple[Optional[dict], Optional[str]]:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg})"
    if not isinstance(row, dict):
        return None, f"not a JSON object (got {type(row).__name__})"
    return row, None


def _jsonl_rows(part: _Part, streaming: bool) -> Iterator[Row]:
    for lineno, line in enumerate(_lines(part, streaming), 1):
        if line.strip():
            data, err = _json_row(line)
            yield Row(part.label, "line", lineno, data, err)


def _json_list_rows(part: _Part, streaming: bool) -> Iterator[Row]:
    """A .json file holding one list of objects (read whole: a JSON list cannot be streamed by row)."""
    d = _load_file("text", part.path, streaming, sample_by="document", keep_linebreaks=True)
    text = "".join(t for b in _batches(d) for t in b["text"])
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{part.label}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, list):
        raise DataError(f"{part.label}: expected a JSON list of objects, got {type(data).__name__}")
    for i, row in enumerate(data, 1):
        ok = isinstance(row, dict)
        yield Row(part.label, "item", i, row if ok else None, None if ok else f"not a JSON object (got {type(row).__name__})")


class _LineFeed:
    """Feeds lines to csv.reader and counts them, so each record's first line is known."""

    def __init__(self, lines: Iterator[str]):
        self.lines, self.count = lines, 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = next(self.lines)
        self.count += 1
        return line


def _delimited_rows(part: _Part, streaming: bool, delimiter: str) -> Iterator[Row]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # FRAMES / SealQA cells can be long
    feed = _LineFeed(_lines(part, streaming, keep_linebreaks=True))
    reader = csv.reader(feed, delimiter=delimiter)
    try:
        header = next(reader, None)
        if header is None:
            return
        start = feed.count + 1
        for cells in reader:
            lineno, start = start, feed.count + 1
            if not any(c.strip() for c in cells):
                continue
            if len(cells) != len(header):
                yield Row(part.label, "line", lineno, None, f"{len(cells)} fields, header has {len(header)}")
                continue
            yield Row(part.label, "line", lineno, dict(zip(header, cells)))
    except csv.Error as e:
        raise DataError(f"{part.label}:{feed.count}: not valid {'TSV' if delimiter == chr(9) else 'CSV'} ({e})") from None


def _arrow_rows(part: _Part, streaming: bool) -> Iterator[Row]:
    i = 0
    for batch in _batches(_arrow_split(part, streaming)):
        cols = list(batch)
        for values in zip(*(batch[c] for c in cols)):
            i += 1
            yield Row(part.label, "row", i, dict(zip(cols, values)))


def _part_rows(part: _Part, streaming: bool) -> Iterator[Row]:
    if part.saved:
        return _arrow_rows(part, streaming)
    suffix = part.path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_rows(part, streaming)
    if suffix == ".json":
        return _json_list_rows(part, streaming)
    if suffix in (".csv", ".tsv"):
        return _delimited_rows(part, streaming, "\t" if suffix == ".tsv" else ",")
    return _arrow_rows(part, streaming)


def iter_rows(path: str | os.PathLike, split: Optional[str] = None, streaming: bool = False) -> Iterator[Row]:
    """Every row of one split of `path` (module docstring), in file order. Unreadable rows (bad JSON, a
    CSV record with the wrong field count) come as Rows with `error` set, for the reader to raise or count."""
    for part in _parts(path, split):
        yield from _part_rows(part, streaming)


def column_names(path: str | os.PathLike, split: Optional[str] = None) -> list[str]:
    """The columns of a split: a CSV/TSV header, the keys of a JSON file's first readable row, or the
    Arrow schema's names."""
    part = _parts(path, split)[0]
    suffix = part.path.suffix.lower()
    if part.saved or suffix in ARROW_SUFFIXES:
        d = _arrow_split(part, streaming=True)
        if d.column_names is not None:
            return list(d.column_names)
        return [str(k) for k in next(iter(d), {})]
    if suffix in (".csv", ".tsv"):
        header = next(csv.reader(_lines(part, True, keep_linebreaks=True), delimiter="\t" if suffix == ".tsv" else ","), [])
        return [c.lstrip("\ufeff") for c in header]
    for row in _part_rows(part, streaming=True):
        if row.data is not None:
            return [str(k) for k in row.data]
    return []


# ------------------------------------------------------------------------------ random access
class RowTable(Sequence):
    """The readable rows of one split as a random-access sequence over memory-mapped Arrow: rows are
    parsed when indexed, not held in memory (SFT's mix sampler draws by index from sets of any size).

    Building it reads every row once, so a bad row is an error at load time ("file:line: ..."), as
    with an eager list; the table then keeps only the Arrow data and one int per row."""

    def __init__(self, path: str | os.PathLike, split: Optional[str] = None):
        self._tables: list[tuple[_Part, Any, str]] = []  # (part, Dataset, kind)
        self._part = array("i")  # per row: which table
        self._pos = array("q")  # per row: its Arrow row in that table
        self._num = array("q")  # per row: its line (text) or row number (Arrow)
        for t, part in enumerate(_parts(path, split)):
            suffix = part.path.suffix.lower()
            if part.saved or suffix in ARROW_SUFFIXES:
                d = _arrow_split(part, streaming=False)
                kind = "arrow"
                for i in range(len(d)):
                    self._add(t, i, i + 1)
            elif suffix == ".jsonl":
                d = _load_file("text", part.path, streaming=False)
                kind = "jsonl"
                i = 0
                for batch in _batches(d):
                    for line in batch["text"]:
                        if line.strip():
                            data, err = _json_row(line)
                            if err:
                                raise DataError(f"{part.label}:{i + 1}: {err}")
                            self._add(t, i, i + 1)
                        i += 1
            else:
                raise DataError(f"{part.label}: random access needs JSONL, parquet, Arrow or a saved folder "
                                f"(got {suffix!r}); convert it to JSONL first")
            self._tables.append((part, d, kind))

    def _add(self, table: int, pos: int, num: int) -> None:
        self._part.append(table)
        self._pos.append(pos)
        self._num.append(num)

    def __len__(self) -> int:
        return len(self._pos)

    def row(self, i: int) -> Row:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        part, d, kind = self._tables[self._part[i]]
        rec = d[int(self._pos[i])]
        if kind == "jsonl":
            data, err = _json_row(rec["text"])
            return Row(part.label, "line", int(self._num[i]), data, err)
        return Row(part.label, "row", int(self._num[i]), rec)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.row(i).data


def row_table(path: str | os.PathLike, split: Optional[str] = None) -> RowTable:
    """A RowTable of one split of `path` (JSONL, parquet, Arrow or a saved / Hub-layout folder of them)."""
    return RowTable(path, split)
