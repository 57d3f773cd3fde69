"""Format augmentation (RECIPE 4.1) and the final synthetic QA records."""
from __future__ import annotations

import hashlib
import random

from ..records import QARecord
from .stages import VerifiedRecord


def split_of(key: str, validation_fraction: float) -> str:
    """Deterministic split from a hash of the key (stable across runs and machines)."""
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "validation" if h < validation_fraction else "train"


def to_records(verified: list[VerifiedRecord], instructions: dict[str, str], augment_fraction: float,
               validation_fraction: float, seed: int) -> list[QARecord]:
    """One record per verified question, plus a format-augmented copy (same answer) for a fraction."""
    rng = random.Random(seed)
    out = []
    for v in verified:
        c = v.chain
        split = split_of(c.id, validation_fraction)  # augmented copies share the split: no leakage
        meta = {"answer_type": c.answer_type, "seed_query": c.seed_query, "solvers": v.solvers}
        base = QARecord(c.id, v.question, [c.answer], "synthetic", split, meta, c.hops, c.claims())
        out.append(base)
        if instructions and rng.random() < augment_fraction:
            key = rng.choice(sorted(instructions))
            out.append(QARecord(f"{c.id}-fmt", v.question, [c.answer], "synthetic", split, dict(meta, format_key=key),
                                c.hops, c.claims(), instructions[key]))
    return out
