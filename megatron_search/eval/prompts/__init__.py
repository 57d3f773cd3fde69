"""Versioned eval prompt files (name_vN.txt); lines starting with '#' are comments."""
from __future__ import annotations

from pathlib import Path

PROMPT_DIR = Path(__file__).parent


def load_prompt(name: str) -> str:
    """The text of prompts/<name>.txt (e.g. "simpleqa_judge_v1"), comment lines removed."""
    path = PROMPT_DIR / f"{name}.txt"
    if not path.is_file():
        known = sorted(p.stem for p in PROMPT_DIR.glob("*.txt"))
        raise FileNotFoundError(f"no eval prompt file {path.name} in {PROMPT_DIR} (known: {known})")
    lines = path.read_text(encoding="utf-8").splitlines()
    return "\n".join(l for l in lines if not l.startswith("#")).strip()
