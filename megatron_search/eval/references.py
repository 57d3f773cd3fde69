"""The write-up's reference points (eval/reference_points.yaml), for the report to show beside our curve.

A point is (benchmark, model, b, accuracy, cents per query or None, how it was obtained: "quoted" or
"derived: <arithmetic on quoted figures>"). They are the write-up's numbers on its own models, full sets and
grader, so the report labels every one "write-up:" and keeps them out of our curve and TensorBoard scalars.
`missing` names benchmarks the write-up plots without figures we could quote; `notes` are its qualitative
statements, verbatim; `assumptions` say how the quoted sentence was read.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import yaml

DEFAULT_REFERENCES = Path(__file__).with_name("reference_points.yaml")
WRITE_UP = "write-up"  # the label prefix of every reference row and marker


@dataclass(frozen=True)
class ReferencePoint:
    benchmark: str
    model: str
    budget: int
    accuracy: float  # fraction, as our curve's accuracy (the file holds percent)
    cents_per_query: Optional[float]
    how: str

    @property
    def label(self) -> str:
        return f"{WRITE_UP}: {self.model}"


@dataclass(frozen=True)
class References:
    source: dict
    points: tuple[ReferencePoint, ...]
    missing: dict  # benchmark -> why nothing is drawn for it
    notes: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()

    def for_benchmarks(self, benchmarks) -> "References":
        """The part of the table that concerns `benchmarks` (what a report with those sets shows)."""
        keep = set(benchmarks)
        return References(self.source, tuple(p for p in self.points if p.benchmark in keep),
                          {b: why for b, why in self.missing.items() if b in keep}, self.notes, self.assumptions)

    def to_dict(self) -> dict:
        return {"source": dict(self.source), "points": [asdict(p) for p in self.points],
                "missing": dict(self.missing), "notes": list(self.notes), "assumptions": list(self.assumptions)}


def _point(row, where: str) -> ReferencePoint:
    need = ("benchmark", "model", "budget", "accuracy_pct", "how")
    if not isinstance(row, dict) or any(k not in row for k in need):
        raise ValueError(f"{where}: needs {list(need)} (and optionally cents_per_query)")
    budget, acc, cents = row["budget"], row["accuracy_pct"], row.get("cents_per_query")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise ValueError(f"{where}: budget must be an integer >= 0, got {budget!r}")
    if not isinstance(acc, (int, float)) or isinstance(acc, bool) or not 0 <= acc <= 100:
        raise ValueError(f"{where}: accuracy_pct must be a number in [0, 100], got {acc!r}")
    if cents is not None and (not isinstance(cents, (int, float)) or isinstance(cents, bool) or cents < 0):
        raise ValueError(f"{where}: cents_per_query must be a number >= 0 or absent, got {cents!r}")
    how = str(row["how"])
    if how != "quoted" and not how.startswith("derived:") and not how.startswith("read from"):
        raise ValueError(f"{where}: how must be 'quoted', 'derived: ...' or 'read from ...', got {how!r}")
    return ReferencePoint(str(row["benchmark"]), str(row["model"]), budget, acc / 100.0,
                          None if cents is None else float(cents), how)


def load_references(path: Optional[str | Path] = None) -> References:
    """The reference table; a malformed file or row is an error naming the file and the row."""
    path = Path(path) if path else DEFAULT_REFERENCES
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"reference points {path}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("points", []), list):
        raise ValueError(f"reference points {path}: expected a mapping with a 'points' list")
    source = data.get("source") or {}
    if not isinstance(source, dict) or not source.get("url"):
        raise ValueError(f"reference points {path}: 'source' must name at least the url the figures come from")
    points = tuple(_point(r, f"reference points {path}: point {i + 1}") for i, r in enumerate(data.get("points") or []))
    seen = set()
    for p in points:
        key = (p.benchmark, p.model, p.budget)
        if key in seen:
            raise ValueError(f"reference points {path}: two points for {key}")
        seen.add(key)
    missing, notes, assumptions = data.get("missing") or {}, data.get("notes") or [], data.get("assumptions") or []
    if not isinstance(missing, dict) or not isinstance(notes, list) or not isinstance(assumptions, list):
        raise ValueError(f"reference points {path}: 'missing' must be a mapping, 'notes' and 'assumptions' lists")
    return References(dict(source), points, {str(k): str(v) for k, v in missing.items()}, tuple(map(str, notes)),
                      tuple(map(str, assumptions)))


def references_from_dict(d: Optional[dict]) -> Optional[References]:
    """report.json's "references" entry back into a References (None when the report has none)."""
    if not d:
        return None
    pts = tuple(ReferencePoint(**p) for p in d.get("points", []))
    return References(d.get("source", {}), pts, d.get("missing", {}), tuple(d.get("notes", [])),
                      tuple(d.get("assumptions", [])))
