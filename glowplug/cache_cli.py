"""`glowplug cache ls | verify | prune`: the artifact store from the command line (rich tables, JSON with --json).

The flags are validated by the pydantic models below, like every other flag; the store itself is imported only
when a command runs, so building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import textwrap
import time
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from rich.text import Text

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class CacheFlags(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    cache: str | None = Field(
        None, description="Only this cache (model, quant, compile, ...: see `glowplug cache ls`)."
    )
    as_json: bool = Field(False, alias="json", description="JSON on stdout instead of a table.")
    wide: bool = Field(False, description="One wide row per entry with every column and the full factors.")

    @field_validator("cache")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        if v is not None:
            from glowplug.base.artifacts.caches import by_name

            by_name(v)  # raises, naming the caches there are
        return v


class VerifyFlags(CacheFlags):
    full: bool = Field(False, description="Hash every byte (default: sizes, headers and small files).")


class PruneFlags(CacheFlags):
    older_than: float | None = Field(None, description="Also remove entries unused for this long (e.g. 30d, 12h).")
    corrupt: bool = Field(False, description="Also remove damaged entries and files the store did not make.")
    everything: bool = Field(False, alias="all", description="Remove everything under the cache dir.")
    dry_run: bool = Field(False, description="Only say what would be removed.")

    @field_validator("older_than", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        if v is None or isinstance(v, (int, float)):
            return v
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", str(v))
        if m is None:
            raise ValueError(f"{v!r} is not a duration; write a number and a unit: 90s, 30m, 12h, 7d or 2w")
        return float(m.group(1)) * _UNITS[m.group(2)]


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"


def _ago(t: float) -> str:
    if t <= 0:
        return "?"
    s = time.time() - t
    for unit, secs in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= secs:
            return f"{s / secs:.0f}{unit} ago"
    return "just now"


def _factors(factors: dict[str, Any] | None, *, full: bool = False) -> str:
    """`a=1, source.file=x.gguf, engine_config={25 fields}`: what an entry is keyed on. A nested table of a few
    fields is spelled out (dotted keys); a big one is counted, unless `full` (--wide; --json has everything)."""
    if not factors:
        return ""

    def value(v: Any) -> str:
        return v if isinstance(v, str) else json.dumps(v, sort_keys=True)

    parts = []
    for k, v in factors.items():
        if isinstance(v, dict) and (full or len(v) <= 4):
            parts += [f"{k}.{sub}={value(x)}" for sub, x in v.items()]
        elif isinstance(v, dict):
            parts.append(f"{k}={{{len(v)} fields}}")
        else:
            parts.append(f"{k}={value(v)}")
    return ", ".join(parts)


def _made_by(it: Any) -> str:
    m = it.manifest
    return f"glowplug {m.producer.glowplug} / torch {m.producer.torch}" if m else ""


def _width() -> int:
    """The width to fit: COLUMNS when set (a pipe too: `COLUMNS=80 glowplug cache ls | less`), else the terminal's,
    else 200 for a pipe or a file (lines there are read whole, not wrapped by a terminal)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return shutil.get_terminal_size((200, 24)).columns if sys.stdout.isatty() else 200


def _wrap(text: str, width: int) -> list[str]:
    """`text` as indented lines under an entry, broken at spaces only (a key, a path or a name stays whole)."""
    return textwrap.wrap(
        text,
        width=max(width, 20),
        initial_indent="    ",
        subsequent_indent="      ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def _listing(title: str, items: list[Any], width: int, *, result: bool = False) -> list[Text]:
    """Entries as lines that fit `width`: one line of short columns per entry (cache, key, size, last use or the
    verify result, then the model), and under it the factors (or the problem) and the producer, wrapped at spaces.
    No name is ever broken: a model name that does not fit moves whole onto the next line."""
    from rich.text import Text

    cols = ["cache", "key", "size", "verify" if result else "last used"]
    rows = []
    for it in items:
        status = ("ok" if it.problem is None else "DAMAGED") if result else _ago(it.last_used)
        kind = "" if it.kind == "entry" else f" ({it.kind})"
        rows.append([it.cache + kind, it.name, _size(it.size), status])
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i == 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    # The cache dir goes on a line of its own when the title and it do not fit together (a path is never broken).
    name, _, root = title.rpartition(": ")
    heading = [Text(title, style="bold")] if len(title) <= width else [Text(name, style="bold"), Text("  " + root)]
    out = [*heading, Text(line(cols) + "  model", style="bold")]
    for it, cells in zip(items, rows):
        head = line(cells)
        model = it.manifest.group if it.manifest else ""
        if model and len(head) + 2 + len(model) > width:
            out.append(Text(head.rstrip(), style="red" if result and it.problem else ""))
            out.append(Text("    model " + model))
        else:
            out.append(Text(f"{head}  {model}".rstrip(), style="red" if result and it.problem else ""))
        if it.problem and (result or it.manifest is None):
            out.extend(Text(w, style="red") for w in _wrap(f"problem: {it.problem}", width))
        elif not result:
            factors = _factors(it.manifest.factors if it.manifest else None)
            for text in ([f"factors: {factors}"] if factors else []) + [f"made by {_made_by(it)}"] * bool(it.manifest):
                out.extend(Text(w, style="dim") for w in _wrap(text, width))
    return out


def _table(title: str, items: list[Any], *, result: bool = False) -> Any:
    """The --wide layout: every column on the entry's row, factors in full."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("cache", "key", "kind", "model", "size", "last used", "made by"):
        t.add_column(col, justify="right" if col == "size" else "left", no_wrap=True)
    t.add_column("verify" if result else "factors", no_wrap=True)
    for it in items:
        m = it.manifest
        last = "" if result else _factors(m.factors if m else None, full=True) or (it.problem or "")
        if result:
            last = "ok" if it.problem is None else f"[red]{it.problem}[/red]"
        t.add_row(
            it.cache, it.name, it.kind, m.group if m else "", _size(it.size), _ago(it.last_used), _made_by(it), last
        )
    return t


def _show(out: Any, flags: CacheFlags, title: str, items: list[Any], *, result: bool = False) -> None:
    if flags.wide:
        from rich.console import Console
        from rich.measure import Measurement

        table = _table(title, items, result=result)
        # As wide as the rows are: a --wide row is never wrapped or cut, whatever the terminal's width.
        natural = Measurement.get(out, out.options.update(width=100_000), table).maximum
        Console(file=out.file, width=max(natural, out.width), highlight=False).print(table)
        return
    for text in _listing(title, items, out.width, result=result):
        out.print(text, crop=False, soft_wrap=True)


def _store() -> Any:
    from glowplug.base.artifacts import ArtifactStore

    return ArtifactStore()


def _run(args: argparse.Namespace, flags_cls: type[CacheFlags], body: Any) -> int:
    from rich.console import Console

    from glowplug.base.artifacts import CacheDirUnusable

    flags = flags_cls.model_validate({k: v for k, v in vars(args).items() if k in _FLAG_NAMES})
    try:
        out = Console(width=_width(), highlight=False)
        return int(body(flags, _store(), out))
    except CacheDirUnusable as exc:
        Console(stderr=True, soft_wrap=True).print(f"glowplug: error: {exc}", markup=False)
        return 2


def _ls(flags: CacheFlags, store: Any, out: Any) -> int:
    from glowplug.base.artifacts.admin import scan

    items = scan(store, flags.cache)
    if flags.as_json:
        print(json.dumps({"root": str(store.root), "items": [i.to_dict() for i in items]}, indent=1))
        return 0
    _show(out, flags, f"glowplug cache: {store.root}", items)
    out.print(f"{len(items)} item(s), {_size(sum(i.size for i in items))} in all")
    return 0


def _verify(flags: VerifyFlags, store: Any, out: Any) -> int:
    from glowplug.base.artifacts.admin import scan, verify

    items = [
        i
        for i in verify(store, scan(store, flags.cache), "full" if flags.full else "quick")
        if i.kind in ("entry", "damaged")
    ]
    bad = [i for i in items if i.problem is not None]
    if flags.as_json:
        rows = [{**i.to_dict(), "ok": i.problem is None} for i in items]
        print(json.dumps({"root": str(store.root), "mode": "full" if flags.full else "quick", "items": rows}, indent=1))
    else:
        _show(
            out, flags, f"glowplug cache verify ({'full' if flags.full else 'quick'}): {store.root}", items, result=True
        )
        tail = "; remove them with `glowplug cache prune --corrupt`" if bad else ""
        out.print(f"{len(items)} entr{'y' if len(items) == 1 else 'ies'}, {len(bad)} damaged{tail}")
    return 1 if bad else 0


def _prune(flags: PruneFlags, store: Any, out: Any) -> int:
    from glowplug.base.artifacts.admin import prune_plan, remove, scan, verify

    items = scan(store, flags.cache)
    if flags.corrupt:
        items = verify(store, items, "quick")
    plan = prune_plan(store, items, older_than_s=flags.older_than, corrupt=flags.corrupt, everything=flags.everything)
    if not flags.dry_run:
        for it, _ in plan:
            remove(it)
    freed = sum(it.size for it, _ in plan)
    verb = "would remove" if flags.dry_run else "removed"
    if flags.as_json:
        rows = [{**it.to_dict(), "why": why} for it, why in plan]
        print(
            json.dumps(
                {"root": str(store.root), "dry_run": flags.dry_run, "removed": rows, "freed_bytes": freed}, indent=1
            )
        )
        return 0
    for it, why in plan:
        out.print(f"{verb} {it.path} ({_size(it.size)}): {why}", markup=False)
    out.print(f"{verb} {len(plan)} item(s), {_size(freed)}")
    return 0


_FLAG_NAMES = {"cache", "json", "wide", "full", "older_than", "corrupt", "all", "dry_run"}


def register(sub: Any) -> None:
    """Add `glowplug cache ...` to the top-level subparsers."""
    cache = sub.add_parser("cache", help="Inspect, verify and prune the artifact caches (GLOWPLUG_CACHE_DIR).")
    csub = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--cache", help=CacheFlags.model_fields["cache"].description)
        p.add_argument("--json", action="store_true", help=CacheFlags.model_fields["as_json"].description)
        p.add_argument("--wide", action="store_true", help=CacheFlags.model_fields["wide"].description)

    ls = csub.add_parser("ls", help="List entries with their sizes, factors and last use.")
    common(ls)
    ls.set_defaults(func=lambda a: _run(a, CacheFlags, _ls))
    ver = csub.add_parser("verify", help="Check every entry against its manifest (exit 1 if one is damaged).")
    common(ver)
    ver.add_argument("--full", action="store_true", help=VerifyFlags.model_fields["full"].description)
    ver.set_defaults(func=lambda a: _run(a, VerifyFlags, _verify))
    pr = csub.add_parser("prune", help="Remove quarantined entries and unfinished writes, and what the flags add.")
    common(pr)
    pr.add_argument("--older-than", metavar="DURATION", help=PruneFlags.model_fields["older_than"].description)
    pr.add_argument("--corrupt", action="store_true", help=PruneFlags.model_fields["corrupt"].description)
    pr.add_argument("--all", action="store_true", help=PruneFlags.model_fields["everything"].description)
    pr.add_argument("--dry-run", action="store_true", help=PruneFlags.model_fields["dry_run"].description)
    pr.set_defaults(func=lambda a: _run(a, PruneFlags, _prune))
