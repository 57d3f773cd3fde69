"""Base class for every config section: typed, keyword-only, unknown keys rejected."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. Unknown keys are errors (a typo must never be silently ignored)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())
