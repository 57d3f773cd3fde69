"""Cost per query from recorded token counts and a list-price table (RECIPE 8).

The table (eval/prices.yaml, or eval.prices) maps a price name to USD per 1M input and output
tokens, the date the figures were taken and their source, and optionally a note (a secondary source, a
long-context tier the flat rate does not model). cents/query = (tokens_in * input +
tokens_out * output) / 1e6 * 100, with the no-cache token counts of sweep.rollout_tokens. Cost is
linear in the counts, so the cost at the mean token counts is the mean cost per query.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

DEFAULT_PRICES = Path(__file__).with_name("prices.yaml")
_FIELDS = ("input_usd_per_1m", "output_usd_per_1m", "date", "source")


@dataclass(frozen=True)
class Price:
    name: str
    input_usd_per_1m: float
    output_usd_per_1m: float
    date: str
    source: str
    note: str = ""


def load_prices(path: Optional[str | Path] = None) -> dict[str, Price]:
    """The price table; every row needs the four fields (a note is optional), prices >= 0 (errors name file
    and row)."""
    path = Path(path) if path else DEFAULT_PRICES
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"price table {path}: {e}") from None
    rows = data.get("models") if isinstance(data, dict) else None
    if not isinstance(rows, dict) or not rows:
        raise ValueError(f"price table {path}: expected a 'models' mapping of name -> prices")
    out = {}
    for name, row in rows.items():
        if not isinstance(row, dict) or any(f not in row for f in _FIELDS):
            raise ValueError(f"price table {path}: model {name!r} needs {list(_FIELDS)}")
        try:
            p_in, p_out = float(row["input_usd_per_1m"]), float(row["output_usd_per_1m"])
        except (TypeError, ValueError):
            raise ValueError(f"price table {path}: model {name!r}: prices must be numbers") from None
        if p_in < 0 or p_out < 0:
            raise ValueError(f"price table {path}: model {name!r}: prices must be >= 0")
        out[str(name)] = Price(str(name), p_in, p_out, str(row["date"]), str(row["source"]), str(row.get("note") or ""))
    return out


def cents_per_query(tokens_in: float, tokens_out: float, price: Price) -> float:
    if tokens_in < 0 or tokens_out < 0:
        raise ValueError(f"token counts must be >= 0, got in={tokens_in} out={tokens_out}")
    return (tokens_in * price.input_usd_per_1m + tokens_out * price.output_usd_per_1m) / 1e6 * 100.0
