"""`glowplug cache ls | verify | prune`: the artifact store from the command line (rich tables, JSON with --json).

The flags are validated by the pydantic models below, like every other flag; the store itself is imported only
when a command runs, so building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class CacheFlags(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    cache: str | None = Field(None, description="Only this cache (model, quant, compile, ...: see `glowplug cache ls`).")
    as_json: bool = Field(False, alias="json", description="JSON on stdout instead of a table.")

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


def _factors(factors: dict[str, Any] | None) -> str:
    if not factors:
        return ""
    parts = []
    for k, v in factors.items():
        shown = f"{{{len(v)} fields}}" if isinstance(v, dict) and len(v) > 3 else json.dumps(v, sort_keys=True)
        parts.append(f"{k}={shown if len(shown) <= 40 else shown[:37] + '...'}")
    return ", ".join(parts)


def _table(title: str, items: list[Any], *, result: bool = False) -> Any:
    from rich.table import Table

    t = Table(title=title)
    for col in ("cache", "key", "kind", "model", "size", "last used", "made by"):
        t.add_column(col, justify="right" if col == "size" else "left", no_wrap=col in ("key", "size", "last used"))
    t.add_column("verify" if result else "factors", overflow="fold")
    for it in items:
        m = it.manifest
        made = f"glowplug {m.producer.glowplug} / torch {m.producer.torch}" if m else ""
        last = "" if result else _factors(m.factors if m else None) or (it.problem or "")
        if result:
            last = "ok" if it.problem is None else f"[red]{it.problem}[/red]"
        t.add_row(it.cache, it.name, it.kind, m.group if m else "", _size(it.size), _ago(it.last_used), made, last)
    return t


def _store() -> Any:
    from glowplug.base.artifacts import ArtifactStore

    return ArtifactStore()


def _run(args: argparse.Namespace, flags_cls: type[CacheFlags], body: Any) -> int:
    from rich.console import Console

    from glowplug.base.artifacts import CacheDirUnusable

    flags = flags_cls.model_validate({k: v for k, v in vars(args).items() if k in _FLAG_NAMES})
    try:
        # A pipe or file gets the table at a readable width instead of rich's 80-column default.
        out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
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
    out.print(_table(f"glowplug cache: {store.root}", items))
    out.print(f"{len(items)} item(s), {_size(sum(i.size for i in items))} in all")
    return 0


def _verify(flags: VerifyFlags, store: Any, out: Any) -> int:
    from glowplug.base.artifacts.admin import scan, verify

    items = [i for i in verify(store, scan(store, flags.cache), "full" if flags.full else "quick")
             if i.kind in ("entry", "damaged")]  # fmt: skip
    bad = [i for i in items if i.problem is not None]
    if flags.as_json:
        rows = [{**i.to_dict(), "ok": i.problem is None} for i in items]
        print(json.dumps({"root": str(store.root), "mode": "full" if flags.full else "quick", "items": rows}, indent=1))
    else:
        out.print(_table(f"glowplug cache verify ({'full' if flags.full else 'quick'}): {store.root}", items,
                         result=True))  # fmt: skip
        tail = f"; remove them with `glowplug cache prune --corrupt`" if bad else ""
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
        print(json.dumps({"root": str(store.root), "dry_run": flags.dry_run, "removed": rows, "freed_bytes": freed},
                         indent=1))  # fmt: skip
        return 0
    for it, why in plan:
        out.print(f"{verb} {it.path} ({_size(it.size)}): {why}", markup=False)
    out.print(f"{verb} {len(plan)} item(s), {_size(freed)}")
    return 0


_FLAG_NAMES = {"cache", "json", "full", "older_than", "corrupt", "all", "dry_run"}


def register(sub: Any) -> None:
    """Add `glowplug cache ...` to the top-level subparsers."""
    cache = sub.add_parser("cache", help="Inspect, verify and prune the artifact caches (GLOWPLUG_CACHE_DIR).")
    csub = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--cache", help=CacheFlags.model_fields["cache"].description)
        p.add_argument("--json", action="store_true", help=CacheFlags.model_fields["as_json"].description)

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
