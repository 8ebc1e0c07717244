"""Workspaces: store entries another tool fills in place (Inductor's cache folder), so they cannot be written
through a temporary folder and a rename like other entries.

The store seals a workspace after each use (its manifest records every file with size, mtime and checksum, re-
hashing only new or changed files) and verifies it before the next: a file that fails its check is moved aside
and dropped from the manifest (the tool rebuilds it on demand), one `cache_corrupt` event for the lot; a workspace
whose manifest is damaged or was written for other factors is moved aside whole. Files the tool wrote since the
last seal are not checked (a first fill may still be running in another process).

On a cache dir that cannot be written but holds the workspace (a read-only image layer or shared mount), the tool
still gets a folder it can write, because it insists on writing even when everything hits (Inductor creates a
lock file under `locks/` for every kernel library it loads from its cache, seen with strace on a warm start): a
private temporary folder holding a symbolic link to each sound file of the stored workspace. The tool reads its
hits through the links, from the read-only dir, and writes into the private folder; nothing is attempted in the
cache dir, and a hit says nothing.
What the tool had to build there anyway (a damaged file left out, a configuration never compiled) is a miss that
cannot be stored: `seal` reports it once as the store's `cache_unusable` bypass, with its one warning line.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glowplug.profiling.names import Event

from .cachedir import CacheDirUnusable, classify, report_event
from .manifest import (
    FORMAT,
    Manifest,
    check_file,
    list_files,
    now_iso,
    producer,
    read_manifest,
    record_file,
    write_manifest,
)
from .store import QUARANTINE, ArtifactStore, CacheSpec


@dataclass
class Workspace:
    """persistent=False: a private temporary folder, used because the cache dir is unusable; removed at exit.
    source: the stored workspace on a read-only cache dir that the private folder links to (module docstring);
    unusable: why the folder is private, kept for the warning `seal` gives when the tool had to build there."""

    spec: CacheSpec
    key: str
    path: Path
    group: str
    factors: dict[str, Any]
    persistent: bool
    healed: list[str] = field(default_factory=list)
    source: Path | None = None
    unusable: CacheDirUnusable | None = None
    bypassed: bool = False  # the bypass (event and warning) was reported already


def _private(store: ArtifactStore, spec: CacheSpec, key: str, factors: dict[str, Any], group: str) -> Workspace:
    path = Path(tempfile.mkdtemp(prefix=f"glowplug-{spec.name}-"))
    atexit.register(shutil.rmtree, path, True)  # "without caching": nothing is left behind
    return Workspace(spec, key, path, group, factors, False)


def open_workspace(
    store: ArtifactStore, spec: CacheSpec, factors: dict[str, Any], *, group: str, skip: tuple[str, ...] = ()
) -> Workspace:
    """The verified workspace for `factors` (see module docstring); a temporary one when the dir is unusable,
    linking to the stored one when the dir is only read-only. skip: path prefixes that are not artifacts (the
    tool's lock files), never linked: a lock taken through a link would write into the read-only dir."""
    key = store.key(spec, factors)
    problem = store.write_problem(spec)
    if problem is not None:
        stored = store.entry_path(spec, key)
        if store.read_problem() is None and stored.is_dir():
            return _linked(store, spec, key, factors, group, stored, problem, skip)
        ws = _private(store, spec, key, factors, group)
        ws.unusable, ws.bypassed = problem, True
        store.bypass(spec, problem)
        return ws
    ws = Workspace(spec, key, store.entry_path(spec, key), group, factors, True)
    try:
        with store.lock(spec, key):
            if ws.path.is_dir():
                _heal(store, ws)
            ws.path.mkdir(parents=True, exist_ok=True)
    except Exception as exc:
        unusable = classify(store.root, exc)
        if unusable is None:
            raise
        store.bypass(spec, unusable)
        return _private(store, spec, key, factors, group)
    return ws


def _linked(
    store: ArtifactStore,
    spec: CacheSpec,
    key: str,
    factors: dict[str, Any],
    group: str,
    stored: Path,
    problem: CacheDirUnusable,
    skip: tuple[str, ...],
) -> Workspace:
    """A private folder linking to the sound files of the read-only workspace `stored`, verified as `_heal` does,
    except that nothing damaged can be moved aside: it is left out (the tool rebuilds it privately) and reported."""
    ws = _private(store, spec, key, factors, group)
    ws.source, ws.unusable = stored, problem
    left_out: set[str] = set()
    bad: list[str] = []
    try:
        m = read_manifest(stored)
    except ValueError as exc:
        if not str(exc).startswith("no manifest"):  # damaged: not one file of it can be trusted
            bad.append(str(exc))
            left_out = set(list_files(stored, skip=skip))
    else:
        if (m.cache, m.version, m.key, m.factors) != (spec.name, spec.version, key, factors):
            bad.append(f"stale: written by glowplug {m.producer.glowplug} / torch {m.producer.torch} for other factors")
            left_out = set(list_files(stored, skip=skip))
        else:
            for rel, rec in m.files.items():
                why = check_file(stored / rel, rec, store.verify)
                if why is not None:
                    bad.append(why)
                    left_out.add(rel)
    for rel in list_files(stored, skip=skip):
        if rel in left_out or rel.endswith(".tmp"):
            continue
        link = ws.path / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(stored / rel)
    if bad:
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        reason = f"{len(bad)} damaged: {bad[0]}{more}"
        store.leave_in_place(spec, stored, reason)
        ws.healed.append(f"{spec.name}: {reason}")
        ws.bypassed = True  # what was left out is rebuilt and cannot be stored: a miss on a read-only dir
        store.bypass(spec, problem)
    return ws


def _heal(store: ArtifactStore, ws: Workspace) -> None:
    try:
        m = read_manifest(ws.path)
    except ValueError as exc:
        if str(exc).startswith("no manifest"):
            return  # never sealed yet (its first fill may be running in another process): nothing to check
        ws.healed.append(store.quarantine(ws.spec, ws.path, str(exc)))
        return
    if (m.cache, m.version, m.key, m.factors) != (ws.spec.name, ws.spec.version, ws.key, ws.factors):
        why = f"stale: written by glowplug {m.producer.glowplug} / torch {m.producer.torch} for other factors"
        ws.healed.append(store.quarantine(ws.spec, ws.path, why))
        return
    kept = dict(m.files)
    bad: list[str] = []
    for rel, rec in m.files.items():
        problem = check_file(ws.path / rel, rec, store.verify)
        if problem is None:
            continue
        del kept[rel]
        bad.append(problem)
        if (ws.path / rel).exists():
            store.quarantine(ws.spec, ws.path / rel, problem, report=False)
    if bad:
        # One event for the lot: a damaged cache tends to be damaged in many files at once.
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        reason = f"{len(bad)} of {len(m.files)} files damaged: {bad[0]}{more}"
        report_event(
            Event.CACHE_CORRUPT,
            cache=ws.spec.name,
            path=ws.path,
            reason=reason,
            action=f"damaged files moved to {store.root / QUARANTINE}; rebuilt on demand",
        )
        ws.healed.append(f"{ws.spec.name}: {reason}")
        write_manifest(ws.path, m.model_copy(update={"files": kept}))


def renew(store: ArtifactStore, ws: Workspace, reason: str) -> None:
    """Move the whole workspace aside (reported) and start an empty one at the same place."""
    if not ws.persistent:
        shutil.rmtree(ws.path, ignore_errors=True)
        ws.path.mkdir(parents=True)
        return
    with store.lock(ws.spec, ws.key):
        if ws.path.exists():
            ws.healed.append(store.quarantine(ws.spec, ws.path, reason))
        ws.path.mkdir(parents=True, exist_ok=True)


def seal(store: ArtifactStore, ws: Workspace, *, skip: tuple[str, ...] = ()) -> None:
    """Record the workspace's current files in its manifest (`skip`: path prefixes that are not artifacts). A
    private folder has no manifest; one standing in for a read-only workspace reports, once, that files the tool
    wrote there (links excepted) cannot be stored."""
    if not ws.persistent:
        if ws.unusable is not None and not ws.bypassed and list_files(ws.path, skip=skip):
            ws.bypassed = True
            store.bypass(ws.spec, ws.unusable)
        return
    try:
        with store.lock(ws.spec, ws.key):
            try:
                old = read_manifest(ws.path).files
            except ValueError:
                old = {}
            files = {}
            for rel in list_files(ws.path, skip=skip):
                if rel.endswith(".tmp"):
                    continue  # another writer's file in flight
                st = (ws.path / rel).stat()
                prev = old.get(rel)
                if prev is not None and (prev.size, prev.mtime_ns) == (st.st_size, st.st_mtime_ns):
                    files[rel] = prev
                else:
                    files[rel] = record_file(ws.path / rel, with_mtime=True)
            write_manifest(
                ws.path,
                Manifest(
                    format=FORMAT,
                    cache=ws.spec.name,
                    version=ws.spec.version,
                    key=ws.key,
                    group=ws.group,
                    factors=ws.factors,
                    files=files,
                    created=now_iso(),
                    producer=producer(),
                ),
            )
    except OSError as exc:
        unusable = classify(store.root, exc)
        if unusable is None:
            raise
        store.bypass(ws.spec, unusable)
