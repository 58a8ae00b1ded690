"""The error every config mistake raises, and the strict base of every section."""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
)


class ConfigError(ValueError):
    """A usage or configuration error: the CLI exits 2 with this message."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)
