"""CLI flags generated from the pydantic schema, so every flag is validated by the same models as HTTP fields
and config files, and a new config field is a new flag with no second list to keep in sync.

The grammar every command shares (generated here, so it cannot drift between commands):
  - the model is the first positional argument, and `--model` says the same thing (`add_model_argument`);
  - a list flag takes one value per use and may be repeated; a list of numbers or names may also be written with
    commas (`--batch-sizes 1,4,16` == `--batch-sizes 1 --batch-sizes 4 --batch-sizes 16`). A flag never takes
    several space-separated values, so it can never swallow the prompt or the model that follows it;
  - a flag whose field is a Literal lists its values in the help (`{none,int8,int4,int2,w8a8}`), the values come
    from the schema and the shown default is the real one;
  - an error prints one short usage line of the command that failed, the error, and where the help is.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from .units import parse_byte_size

DEFAULT_MODEL_NAME = "smollm2"
MODEL_HELP = "'smollm2' (the embedded default), a Hugging Face model folder or a .gguf file"
# Fields whose value is a credential: an error about one never repeats the value given (it would land in logs).
SECRET_FIELDS = frozenset({"api_key"})


class FlagError(ValueError):
    """A bad flag or config file; the message names it and says what to pass instead."""


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage line is short (the positionals and `[options]`, not every flag) and whose
    errors name the command that failed: `glowplug generate: error: ...` with generate's usage, not the top
    level's. Subparsers inherit the class (argparse makes them with the parent's class)."""

    def _short_usage(self) -> str:
        parts = ["%(prog)s"]
        has_options = False
        for action in self._actions:
            if action.option_strings:
                has_options = has_options or not isinstance(action, argparse._HelpAction)
                continue
            if isinstance(action, argparse._SubParsersAction):
                parts.append(f"{action.metavar or 'COMMAND'} ...")
                continue
            name = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
            parts.append(
                {"?": f"[{name}]", "+": f"{name} [{name} ...]", "*": f"[{name} ...]"}.get(
                    action.nargs if isinstance(action.nargs, str) else "", name
                )
            )
        if has_options:
            parts.append("[options]")
        return " ".join(parts)

    def format_usage(self) -> str:
        usage = self.usage if self.usage is not None else self._short_usage()
        return f"usage: {usage % {'prog': self.prog}}\n"

    def format_help(self) -> str:
        saved = self.usage
        self.usage = saved if saved is not None else self._short_usage()
        try:
            return super().format_help()
        finally:
            self.usage = saved

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        # The innermost command parses first and sets this; its parents copy it up and keep it. main() reports
        # leftover arguments through it, so `glowplug serve --bogus` shows serve's usage.
        if not hasattr(parsed, "command_parser"):
            parsed.command_parser = self
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists every option)\n")


def _literal_values(annotation: Any) -> list[Any]:
    """The Literal values anywhere in `annotation` (`int | Literal["auto"] | None` -> ["auto"])."""
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    out: list[Any] = []
    for arg in typing.get_args(annotation):
        out += _literal_values(arg)
    return out


def _plain_types(annotation: Any) -> set[type]:
    """The non-Literal, non-None classes in `annotation` (through unions and Annotated)."""
    if typing.get_origin(annotation) is Literal or annotation is type(None):
        return set()
    if isinstance(annotation, type):
        return {annotation}
    out: set[type] = set()
    for arg in typing.get_args(annotation):
        out |= _plain_types(arg)
    return out


def _is_bool(annotation: Any) -> bool:
    return annotation is bool


def _sequence_item(annotation: Any) -> Any | None:
    """The item type of a tuple/list field (`tuple[int, ...] | None` -> int), else None."""
    if typing.get_origin(annotation) in (tuple, list):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return args[0] if args else str
    for arg in typing.get_args(annotation):
        item = _sequence_item(arg)
        if item is not None:
            return item
    return None


def _is_byte_size(info: FieldInfo) -> bool:
    """A ByteSize field (units.ByteSize): pydantic moves the validator into `metadata` for a bare ByteSize and
    leaves it inside the annotation for `ByteSize | None`."""

    def inside(annotation: Any) -> bool:
        args = typing.get_args(annotation)
        return any(getattr(a, "func", None) is parse_byte_size or inside(a) for a in args)

    return any(getattr(m, "func", None) is parse_byte_size for m in info.metadata) or inside(info.annotation)


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _metavar(name: str, annotation: Any, info: FieldInfo) -> str:
    """What the help shows as the flag's value: its choices, `N|auto`, SIZE, or the field's name."""
    if _is_byte_size(info):
        return "SIZE"
    choices = [str(v) for v in _literal_values(annotation)]
    plain = _plain_types(annotation) - {bool}
    if choices and not plain:
        return "{" + ",".join(choices) + "}"
    kind = "N" if plain <= {int} and plain else "X" if plain <= {int, float} and plain else name.upper()
    return "|".join([kind, *choices])


def _shown_default(name: str, info: FieldInfo, defaults: dict[str, Any]) -> str:
    """The default as the help states it: the caller's, else the field's own `default_text` (what leaving it
    unset means), else the schema default."""
    if name in defaults:
        return str(defaults[name])
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "default_text" in extra:
        return str(extra["default_text"])
    value = info.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) if value else "none"
    return "unset" if value is None else str(value)


class _AppendItems(argparse.Action):
    """A list flag: each use adds its value; `split` also breaks a value at commas (numbers, names)."""

    def __init__(self, option_strings: list[str], dest: str, split: bool = True, **kwargs: Any) -> None:
        self.split = split
        super().__init__(option_strings, dest, nargs=None, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        text = str(values)
        items += [v.strip() for v in text.split(",") if v.strip()] if self.split else [text]
        setattr(namespace, self.dest, items)


def add_model_flags(
    parser: argparse.ArgumentParser | Any,
    model: type[BaseModel],
    *,
    exclude: set[str] = frozenset(),  # type: ignore[assignment]
    defaults: dict[str, Any] | None = None,
) -> list[str]:
    """Add one flag per field (nested models are flattened); returns the field names added.

    defaults: field -> the default to state in the help when the caller, not the schema, supplies it (the value
        itself still comes from wherever the caller takes it; the flag's own default is "not given")."""
    added: list[str] = []
    defaults = defaults or {}
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            added += add_model_flags(parser, ann, exclude=exclude, defaults=defaults)
            continue
        if name in exclude:
            continue
        text = (info.description or "").strip()
        # argparse %-formats help strings: a literal "30%" in a description must reach it as "30%%".
        help_text = f"{text} (default: {_shown_default(name, info, defaults)})".strip().replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        item = _sequence_item(ann)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        # Other engines' names for the same setting (vLLM's --gpu-memory-utilization), accepted as they are.
        names = [flag_name(name), *(flag_name(str(a)) for a in extra.get("flag_aliases", ()))]  # type: ignore[union-attr]
        if _is_bool(ann):
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, **kwargs)
        elif item is not None:
            # Free text (stop strings) may contain commas; numbers and names never do.
            split = not extra.get("free_text", False)
            metavar = _metavar(name, item, FieldInfo(annotation=item))
            kwargs["help"] = help_text + (
                " Repeat the flag for more values" + (", or separate them with commas." if split else ".")
            )
            parser.add_argument(*names, action=_AppendItems, split=split, metavar=metavar, **kwargs)
        else:
            parser.add_argument(*names, metavar=_metavar(name, ann, info), **kwargs)
        added.append(name)
    return added


def add_model_argument(
    parser: argparse.ArgumentParser, *, default: str | None = DEFAULT_MODEL_NAME, positional: bool = True
) -> None:
    """The model, as every command takes it: the first positional argument or `--model` (the same thing; giving
    both with different values is an error). `resolve_model_argument` merges them into `args.model`."""
    if positional:
        parser.add_argument(
            "model",
            nargs="?",
            default=None,
            metavar="MODEL",
            help=f"{MODEL_HELP} (default: {default or 'unset'}); the same as --model.",
        )
    parser.add_argument(
        "--model", dest="model_option", metavar="MODEL", default=None, help="The model, as a flag: " + MODEL_HELP + "."
    )
    parser.set_defaults(model_default=default)


def resolve_model_argument(args: argparse.Namespace) -> None:
    """Merge the positional MODEL and `--model` into `args.model` (raises FlagError when they disagree)."""
    if not hasattr(args, "model_default"):
        return
    given = getattr(args, "model", None)
    option = getattr(args, "model_option", None)
    if given is not None and option is not None and given != option:
        raise FlagError(f"the model is given twice, as {given!r} and as --model {option!r}; give it once")
    args.model_given = bool(option or given)  # a bundle's model is used only when none was given
    args.model = option or given or args.model_default


def load_config_file(path: Path) -> dict[str, Any]:
    """A flat JSON or TOML file of the same field names as the flags."""
    import tomllib  # here, not at the top: only a --config file needs it, every command line imports this module

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
        # A union's branch names (`int`, `literal['auto']`) follow the field; the field is the first part.
        field = loc[0] if loc else "?"
        given = err.get("input")
        # A validator's own message already quotes the value it refused; a credential is never repeated.
        hidden = isinstance(given, dict) or err["type"] == "value_error" or field in SECRET_FIELDS
        shown = "" if hidden else f" (got {given!r})"
        message = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{flag_name(field)}: {message}{shown}")
    # A union field reports once per branch (`int`, `'auto'`); one line per flag and message is enough.
    return "\n".join(dict.fromkeys(lines))
