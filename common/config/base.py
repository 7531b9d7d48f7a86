"""What every config section shares: `_Section` (unknown keys refused, values
validated on assignment, attribute docstrings kept as field descriptions) and the
small value helpers the sections' validators use."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


def yaml_on_off(v: Any) -> Any:
    """YAML 1.1 (and so a ConfigMap or `--set x=off`) reads a bare on/off as a boolean: map it back."""
    return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
