"""CLI flags generated from the pydantic schema, so every flag is validated by the same models as HTTP fields
and config files, and a new config field is a new flag with no second list to keep in sync."""

from __future__ import annotations

import argparse
import json
import tomllib
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

# Fields whose value is a credential: an error about one never repeats the value given (it would land in logs).
SECRET_FIELDS = frozenset({"api_key"})


class FlagError(ValueError):
    """A bad flag or config file; the message names it and says what to pass instead."""


def _is_bool(annotation: Any) -> bool:
    return annotation is bool


def _is_sequence(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (tuple, list):
        return True
    return any(typing.get_origin(a) in (tuple, list) for a in typing.get_args(annotation))


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def add_model_flags(
    parser: argparse.ArgumentParser | Any,
    model: type[BaseModel],
    *,
    exclude: set[str] = frozenset(),  # type: ignore[assignment]
    defaults: dict[str, Any] | None = None,
) -> list[str]:
    """Add one flag per field (nested models are flattened); returns the field names added."""
    added: list[str] = []
    defaults = defaults or {}
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            added += add_model_flags(parser, ann, exclude=exclude, defaults=defaults)
            continue
        if name in exclude:
            continue
        shown = defaults.get(name, info.default)
        help_text = f"{info.description or ''} (default: {shown})".strip()
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if _is_bool(ann):
            parser.add_argument(flag_name(name), action=argparse.BooleanOptionalAction, **kwargs)
        elif _is_sequence(ann):
            parser.add_argument(flag_name(name), nargs="+", metavar="VALUE", **kwargs)
        else:
            parser.add_argument(flag_name(name), metavar=name.upper(), **kwargs)
        added.append(name)
    return added


def load_config_file(path: Path) -> dict[str, Any]:
    """A flat JSON or TOML file of the same field names as the flags."""
    if not path.is_file():
        raise FlagError(f"--config {path}: file not found")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(path.read_text())
        elif path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            raise FlagError(f"--config {path}: use a .json or .toml file")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise FlagError(f"--config {path}: cannot parse ({exc})") from exc
    if not isinstance(data, dict):
        raise FlagError(f"--config {path}: the top level must be a table/object of flag names")
    return {k.replace("-", "_"): v for k, v in data.items()}


def explain(exc: ValidationError) -> str:
    """pydantic's error, phrased in terms of flags: one line per problem, naming the flag and the bad value."""
    lines = []
    for err in exc.errors():
        parts = [str(p) for p in err["loc"] if not str(p).isdigit()]
        # Drop the config section names (scheduler.max_num_seqs -> --max-num-seqs), not a field of that name.
        loc = [p for i, p in enumerate(parts) if not (i < len(parts) - 1 and p in ("scheduler", "cache", "quant"))]
        field = loc[0] if loc else "?"
        given = err.get("input")
        shown = "" if isinstance(given, dict) or field in SECRET_FIELDS else f" (got {given!r})"
        lines.append(f"{flag_name(field)}: {err['msg']}{shown}")
    return "\n".join(lines)
