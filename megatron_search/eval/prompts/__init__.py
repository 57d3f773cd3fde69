"""Versioned eval prompt files (name_vN.txt); lines starting with '#' are comments."""
from __future__ import annotations

from pathlib import Path

from megatron_search.data.prompts import read_prompt

PROMPT_DIR = Path(__file__).parent


def load_prompt(name: str) -> str:
    """The text of prompts/<name>.txt (e.g. "simpleqa_judge_v1"), comment lines removed."""
    return read_prompt(PROMPT_DIR, name)
