"""What `glowplug cache ls | verify | prune` do: walk the store's layout, check entries, remove what is asked.

Kinds of things found under the cache root:
  entry        a store entry (or workspace) with its manifest
  damaged      a folder where an entry should be whose manifest cannot be read
  quarantined  something moved aside after failing verification (kept for a look, never used again)
  leftover     the temporary folder of a write that did not finish (its writer is gone)
  foreign      files or folders not made by this store (e.g. an older glowplug's cache layout)
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from filelock import FileLock, Timeout

from .caches import ALL
from .manifest import MANIFEST, Manifest, VerifyMode, read_manifest
from .store import LOCKS, QUARANTINE, TMP_PREFIX, ArtifactStore

Kind = Literal["entry", "damaged", "quarantined", "leftover", "foreign"]


@dataclass
class Item:
    cache: str
    name: str
    path: Path
    kind: Kind
    size: int
    files: int
    last_used: float
    manifest: Manifest | None = None
    problem: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "cache": self.cache,
            "key": self.name,
            "path": str(self.path),
            "kind": self.kind,
            "size_bytes": self.size,
            "files": self.files,
            "last_used": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.last_used)),
            "model": m.group if m else None,
            "factors": m.factors if m else None,
            "created": m.created if m else None,
            "created_by": m.producer.model_dump() if m else None,
            "problem": self.problem,
        }


def _du(path: Path) -> tuple[int, int]:
    if path.is_file():
        return path.stat().st_size, 1
    total = count = 0
    for dirpath, _dirs, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
                count += 1
            except OSError:
                pass
    return total, count


def _item(cache: str, path: Path, kind: Kind, problem: str | None = None, manifest: Manifest | None = None) -> Item:
    size, files = _du(path)
    stamp = path / MANIFEST if manifest is not None else path
    try:
        used = stamp.stat().st_mtime
    except OSError:
        used = 0.0
    return Item(cache, path.name, path, kind, size, files, used, manifest, problem)


def scan(store: ArtifactStore, cache: str | None = None) -> list[Item]:
    """Everything under the cache root (of one cache when `cache` is given); raises CacheDirUnusable for a file."""
    problem = store.read_problem()
    if problem is not None:
        raise problem
    if not store.root.is_dir():
        return []
    known = {s.name for s in ALL}
    items: list[Item] = []
    for top in sorted(store.root.iterdir()):
        if top.name == QUARANTINE:
            for q in sorted(top.iterdir()):
                owner = q.name.split("-", 1)[0]
                if cache is None or owner == cache:
                    items.append(_item(owner, q, "quarantined", "failed verification earlier"))
            continue
        if cache is not None and top.name != cache:
            continue
        if top.name not in known or not top.is_dir():
            items.append(_item(top.name, top, "foreign", "not made by the artifact store"))
            continue
        for sub in sorted(top.iterdir()):
            if sub.name == LOCKS:
                continue
            if sub.name.startswith(TMP_PREFIX):
                items.append(_item(top.name, sub, "leftover", "an unfinished write"))
            elif not sub.is_dir():
                items.append(_item(top.name, sub, "foreign", "not made by the artifact store"))
            else:
                try:
                    items.append(_item(top.name, sub, "entry", manifest=read_manifest(sub)))
                except ValueError as exc:
                    items.append(_item(top.name, sub, "damaged", str(exc)))
    return items


def verify(store: ArtifactStore, items: list[Item], mode: VerifyMode) -> list[Item]:
    """Check every entry's files against its manifest (`mode` full: every byte); fills `problem`."""
    for it in items:
        if it.kind == "entry":
            _, it.problem = store.check_entry(it.path, mode=mode)
            if it.problem is not None:
                it.kind = "damaged"
    return items


def _writer_alive(store: ArtifactStore, item: Item) -> bool:
    key = item.name[len(TMP_PREFIX) :].split("-", 1)[0]
    lock = FileLock(str(store.root / item.cache / LOCKS / f"{key}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    lock.release()
    return False


def prune_plan(
    store: ArtifactStore, items: list[Item], *, older_than_s: float | None, corrupt: bool, everything: bool
) -> list[tuple[Item, str]]:
    """What `prune` removes, with why. Always: quarantined things and leftovers of writers that are gone."""
    now = time.time()
    plan: list[tuple[Item, str]] = []
    for it in items:
        if everything:
            plan.append((it, "--all"))
        elif it.kind == "quarantined":
            plan.append((it, "quarantined"))
        elif it.kind == "leftover":
            if not _writer_alive(store, it):
                plan.append((it, "unfinished write, writer gone"))
        elif corrupt and it.kind in ("damaged", "foreign"):
            plan.append((it, it.problem or it.kind))
        elif older_than_s is not None and it.kind == "entry" and now - it.last_used > older_than_s:
            plan.append((it, f"unused for {(now - it.last_used) / 86400:.1f} days"))
    return plan


def remove(item: Item) -> None:
    if item.path.is_dir() and not item.path.is_symlink():
        shutil.rmtree(item.path)
    else:
        item.path.unlink(missing_ok=True)
