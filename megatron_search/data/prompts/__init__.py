"""Versioned prompt files (name_vN.txt). Lines starting with '#' are comments."""
from __future__ import annotations

from pathlib import Path

PROMPT_DIR = Path(__file__).parent


def read_prompt(directory: Path, name: str) -> str:
    """The text of <directory>/<name>.txt, comment lines removed (also used by eval/prompts)."""
    path = directory / f"{name}.txt"
    if not path.is_file():
        known = sorted(p.stem for p in directory.glob("*.txt"))
        raise FileNotFoundError(f"no prompt file {path.name} in {directory} (known: {known})")
    lines = path.read_text(encoding="utf-8").splitlines()
    return "\n".join(l for l in lines if not l.startswith("#")).strip()


def load_prompt(name: str) -> str:
    """The text of prompts/<name>.txt (e.g. "rubric_generate_v1"), comment lines removed."""
    return read_prompt(PROMPT_DIR, name)


def load_lines(name: str) -> list[str]:
    return [l for l in load_prompt(name).splitlines() if l.strip()]


def load_keyed(name: str) -> dict[str, str]:
    """A "key<TAB>text" prompt file as {key: text}."""
    out = {}
    for i, line in enumerate(load_lines(name), 1):
        if "\t" not in line:
            raise ValueError(f"prompts/{name}.txt: line {i} is not 'key<TAB>text': {line[:60]!r}")
        key, text = line.split("\t", 1)
        out[key.strip()] = text.strip()
    return out
