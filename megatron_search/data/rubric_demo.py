"""Embedded rubric-chat prompts for the CPU demo (no LLM needed to write them).

Templated rewriting/formatting requests about the synthetic world, in the spirit of RECIPE 4.2's
example ("Plz correct swntence"), each with a reference answer and rubrics in the mechanically
checkable forms of rubric_checks.py, ordered by precedence (explicit, internal, essential).
"""
from __future__ import annotations

import random

from .world import World

CITATION_RUBRIC = {"kind": "internal", "text": "The answer contains no citation markers of the form [type:index]."}


def _fix_request(rng: random.Random, a: str, b: str) -> dict:
    clean = f"You will meet {a} at the station. We have to arrange lodging and boarding for {b}."
    noisy = f"u will meet {a} at the station. We have to arrange lodging & boarding for {b}."
    return {
        "messages": [{"role": "user", "content": f"{noisy} Plz correct swntence."}],
        "reference": clean,
        "rubrics": [{"kind": "explicit", "text": "The answer is in English."},
                    {"kind": "explicit", "text": 'It has no "u", "Plz" or "&".'},
                    CITATION_RUBRIC,
                    {"kind": "essential", "text": 'The corrected sentence contains "lodging" and "boarding".'},
                    {"kind": "essential", "text": f'The answer contains "{a}" and "{b}".'}],
    }


def _bullets_request(rng: random.Random, a: str, b: str, c: str) -> dict:
    return {
        "messages": [{"role": "user", "content": f"Turn this into bullet points please: {a}, {b}, {c}"}],
        "reference": f"- {a}\n- {b}\n- {c}",
        "rubrics": [{"kind": "explicit", "text": "The answer uses bullet points."}, CITATION_RUBRIC,
                    {"kind": "essential", "text": f'The answer contains "{a}", "{b}" and "{c}".'}],
    }


def _short_request(rng: random.Random, a: str, b: str) -> dict:
    n = rng.choice([8, 10, 12])
    text = (f"Yesterday the committee met with {a} for a long discussion about the future plans of {b}, "
            f"which took most of the afternoon and ended without a final decision.")
    return {
        "messages": [{"role": "user", "content": f"Summarize in at most {n} words: {text}"}],
        "reference": f"{a} and {b}'s plans discussed; no decision.",
        "rubrics": [{"kind": "explicit", "text": f"The answer has at most {n} words."},
                    {"kind": "explicit", "text": "The answer is in English."}, CITATION_RUBRIC,
                    {"kind": "essential", "text": f'The answer contains "{a}".'}],
    }


def demo_rubric_rows(world: World, n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    people = sorted(e.name for e in world.entities.values() if e.type == "person")
    places = sorted(e.name for e in world.entities.values() if e.type in ("city", "company", "festival"))
    rows = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            row = _fix_request(rng, rng.choice(people), rng.choice(places))
        elif kind == 1:
            row = _bullets_request(rng, *rng.sample(places, 3))
        else:
            row = _short_request(rng, rng.choice(people), rng.choice(places))
        rows.append({"id": f"rubric-demo-{i:05d}", **row})
    return rows
