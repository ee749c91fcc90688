"""The configuration reference: every leaf field's dotted name, default and description, from the models
(``mentorrl config --reference`` and docs/reference/configuration.md)."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from mentorrl.config.run import RunConfig


def _fmt_default(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "{...}"
    from pydantic_core import to_jsonable_python

    value = to_jsonable_python(value, exclude_none=True)  # e.g. a list of sections
    return "`" + yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip().removesuffix("...").strip() + "`"


def config_reference(model: BaseModel | None = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted field, default, description) for every leaf field of the run config, from the models."""
    model = model if model is not None else RunConfig()
    rows: list[tuple[str, str, str]] = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        dotted = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            rows.extend(config_reference(value, dotted + "."))
            continue
        rows.append((dotted, _fmt_default(value), (info.description or "").replace("|", "\\|")))
        if isinstance(value, list) and value and isinstance(value[0], BaseModel):  # the fields of one list item
            rows.extend(config_reference(value[0], dotted + "[]."))
    return rows


def config_reference_markdown() -> str:
    lines = ["| field | default | meaning |", "|---|---|---|"]
    lines += [f"| `{f}` | {d} | {m} |" for f, d, m in config_reference()]
    return "\n".join(lines) + "\n"


__all__ = ["config_reference", "config_reference_markdown"]
