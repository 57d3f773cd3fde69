"""Load a Config from YAML plus `key.sub=value` overrides, with one error line per problem."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import ValidationError

from .model import resolve_repo_path
from .schema import Config


class ConfigError(ValueError):
    """One or more config problems; `problems` holds one line per problem, naming the field."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s)\n  " + "\n  ".join(problems))


def parse_override(text: str) -> tuple[list[str], Any]:
    """'grpo.group_size=16' -> (['grpo', 'group_size'], 16). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError([f"override {text!r}: expected key.sub=value"])
    key, raw = text.split("=", 1)
    parts = [k for k in key.strip().split(".") if k]
    if not parts:
        raise ConfigError([f"override {text!r}: empty key"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError([f"override {text!r}: value is not valid YAML ({e})"]) from e
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, k in enumerate(parts[:-1]):
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError([f"override {text!r}: {'.'.join(parts[: i + 1])} is not a section"])
            node = child
        node[parts[-1]] = value
    return data


def _format(err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key")
        elif e["type"] == "value_error" and not loc:
            # Cross-field checks: already one line per problem, each naming its field.
            msg = str(e.get("ctx", {}).get("error", e["msg"]))
            lines.extend(msg.splitlines())
        else:
            lines.append(f"{loc}: {e['msg']} (got {e.get('input')!r})")
    return lines


def config_from_dict(data: dict[str, Any], source: str = "config", stage: str | None = None) -> Config:
    """Validate `data`; with a stage (sft, rm, grpo) also that job's checks (schema.stage_problems)."""
    try:
        return Config.model_validate(data, context={"stage": stage})
    except ValidationError as e:
        raise ConfigError(_format(e), source) from None


def load_config(path: str | Path | None = None, overrides: Iterable[str] = (), stage: str | None = None) -> Config:
    """Read YAML (or start from defaults when path is None), apply overrides, validate (for `stage`, if given)."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            loaded = yaml.safe_load(resolve_repo_path(path).read_text())  # configs/... from any directory
        except FileNotFoundError:
            raise ConfigError([f"{path}: no such file"], source) from None
        except yaml.YAMLError as e:
            raise ConfigError([f"{path}: not valid YAML ({e})"], source) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError([f"{path}: top level must be a mapping"], source)
        data = loaded or {}
    return config_from_dict(apply_overrides(data, overrides), source, stage)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
