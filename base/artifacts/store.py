"""The artifact store: every cache of glowplug keeps its entries here, with one key, manifest and failure behaviour.

Layout under the cache root (GLOWPLUG_CACHE_DIR):
    <cache>/<key>/            one entry: its files and manifest.json (written last, inside the temporary folder)
    <cache>/.locks/<key>.lock the lock writers of that entry take
    <cache>/.tmp-<key>-*      an entry being written; renamed to <cache>/<key> when complete
    .quarantine/<cache>-<key>-<time>   entries (or workspace files) that failed verification, moved aside

Entries are immutable once renamed into place, so readers take no lock: a reader sees a whole entry or none.
A workspace (workspace.py) is the one exception: a folder another tool fills in place (Inductor's cache),
verified against the manifest of the files it held when last sealed.

Failures never stop a start: an entry that fails verification or whose `load` raises is moved aside, reported as
a `cache_corrupt` event on the current span (the stage's) and rebuilt. When the cache dir cannot be written
(a file, read-only, disk full), a cache declared `bypass` builds without storing and warns once; one declared
`fail` raises CacheDirUnusable, one line naming GLOWPLUG_CACHE_DIR and the fix.

A read-only cache dir (a container image layer, a shared mount) serves its hits without a write attempted: the
last-use stamp of a hit and a `put(refresh=True)` over a sound entry are skipped silently when the kernel would
refuse the write (asked with access(2), not by trying), since neither loses anything a later start needs; only a
miss, which cannot be stored, warns.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from glowplug.profiling.names import Attr, Event

from .cachedir import (
    CacheDirUnusable,
    cache_dir_from_env,
    classify,
    log,
    read_problem,
    refusal,
    report_event,
    warn_once,
    write_problem,
)
from .caches import ALL, CacheSpec
from .manifest import (
    FORMAT,
    Manifest,
    VerifyMode,
    check_file,
    describe_changes,
    list_files,
    now_iso,
    producer,
    read_manifest,
    record_file,
    verify_mode_from_env,
    write_manifest,
)

T = TypeVar("T")
__all__ = ["ArtifactStore", "CacheDirUnusable", "CacheSpec", "Fetched", "probes_seen"]

# The probes made in the current context, when someone listens (`probes_seen`): (cache, entry folder, would hit).
_PROBES: contextvars.ContextVar[list[tuple[str, Path, bool]] | None] = contextvars.ContextVar(
    "glowplug_probes", default=None
)


@contextmanager
def probes_seen() -> Iterator[list[tuple[str, Path, bool]]]:
    """Every `ArtifactStore.probe` made inside the block, as (cache name, entry folder, would hit): the start-up
    plan reads the entries a start will load (their bytes and page-cache residency) from it."""
    seen: list[tuple[str, Path, bool]] = []
    token = _PROBES.set(seen)
    try:
        yield seen
    finally:
        _PROBES.reset(token)


QUARANTINE = ".quarantine"
LOCKS = ".locks"
TMP_PREFIX = ".tmp-"
# Per cache: the latest is kept to look at what went wrong (a model entry is ~0.5 GB, so no more than that);
# `glowplug cache prune` removes it.
KEEP_QUARANTINED = 1


@dataclass
class Fetched(Generic[T]):
    """What a fetch found or built. `corrupt` lists the entries moved aside on the way (one line each)."""

    value: T
    key: str
    hit: bool
    path: Path | None = None
    miss_reason: str | None = None
    corrupt: list[str] = field(default_factory=list)
    bypassed: str | None = None  # the warning when the cache dir was unusable and nothing was stored
    bundle: str | None = None  # a hit on an entry a bundle brought (bundle.py): the bundle's file name

    def attributes(self) -> dict[str, Any]:
        """The stage-span attributes every cache reports the same way."""
        attrs: dict[str, Any] = {Attr.CACHE_HIT: self.hit, Attr.CACHE_KEY: self.key}
        if self.hit and self.bundle:
            attrs[Attr.CACHE_FROM_BUNDLE] = self.bundle
        if not self.hit and self.miss_reason:
            attrs[Attr.CACHE_MISS_REASON] = self.miss_reason
        return attrs


class ArtifactStore:
    def __init__(self, root: Path | str | None = None, *, verify: VerifyMode | None = None) -> None:
        self.root = Path(root) if root is not None else cache_dir_from_env()
        self.verify: VerifyMode = verify or verify_mode_from_env()

    # ------------------------------------------------------------ keys and paths

    @staticmethod
    def key(spec: CacheSpec, factors: dict[str, Any]) -> str:
        payload = json.dumps({"cache": spec.name, "version": spec.version, "factors": factors}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def folder(self, spec: CacheSpec) -> Path:
        return self.root / spec.name

    def entry_path(self, spec: CacheSpec, key: str) -> Path:
        return self.folder(spec) / key

    # ------------------------------------------------------------ the cache dir itself

    def read_problem(self) -> CacheDirUnusable | None:
        return read_problem(self.root)

    def write_problem(self, spec: CacheSpec) -> CacheDirUnusable | None:
        """Why `spec`'s entries cannot be written, else None."""
        return write_problem(self.root, self.folder(spec) / LOCKS)

    def bypass(self, spec: CacheSpec, problem: CacheDirUnusable) -> str:
        """Say that `spec` runs without storing (an event, and one warning per process); raise instead when the
        cache must not run without the dir."""
        if spec.on_unusable == "fail":
            raise problem
        report_event(
            Event.CACHE_UNUSABLE,
            cache=spec.name,
            path=self.root,
            reason=problem.problem,
            action=f"running without the {spec.name} cache",
        )
        warn_once(problem, [s.name for s in ALL if s.on_unusable == "bypass"])
        return f"{problem}. Running without the {spec.name} cache: {spec.without}"

    # ------------------------------------------------------------ locking, quarantine, install

    @contextmanager
    def lock(self, spec: CacheSpec, key: str) -> Iterator[None]:
        from filelock import FileLock, Timeout  # only a writer locks: a reader of the store need not import it

        lock = FileLock(str(self.folder(spec) / LOCKS / f"{key}.lock"))
        try:
            lock.acquire(timeout=2)
        except Timeout:
            log().info(f"waiting for another glowplug process to finish {spec.name} entry {key}")
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

    def quarantine(self, spec: CacheSpec, path: Path, reason: str, *, report: bool = True) -> str:
        """Move a damaged entry (or file) aside, report it (unless the caller reports a batch), and return the
        one-line reason."""
        dest = self.root / QUARANTINE / f"{spec.name}-{path.name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        if refusal(self.root, path.parent) is not None:  # nothing to try on a read-only dir
            return self.leave_in_place(spec, path, reason, report=report)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.rename(path, dest)
            action = f"moved aside to {dest}; rebuilding"
            self._trim_quarantine(spec)
        except OSError:
            try:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                action = "removed; rebuilding"
            except OSError as exc:
                action = f"left in place (cannot move or remove it: {exc.strerror}); not using it"
        if report:
            report_event(Event.CACHE_CORRUPT, cache=spec.name, path=path, reason=reason, action=action)
        return f"{spec.name} {path.name}: {reason}"

    def leave_in_place(self, spec: CacheSpec, path: Path, reason: str, *, report: bool = True) -> str:
        """A damaged entry (or file) that stays where it is, unused, because the cache dir cannot be written:
        reported (unless the caller reports a batch), and its one-line reason returned, as `quarantine` does."""
        if report:
            action = "left in place (the cache dir is unusable); not using it"
            report_event(Event.CACHE_CORRUPT, cache=spec.name, path=path, reason=reason, action=action)
        return f"{spec.name} {path.name}: {reason}"

    def _trim_quarantine(self, spec: CacheSpec) -> None:
        mine = sorted((p for p in (self.root / QUARANTINE).glob(f"{spec.name}-*")), key=lambda p: p.stat().st_mtime)
        for old in mine[:-KEEP_QUARANTINED]:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)

    def _remove_leftovers(self, spec: CacheSpec, key: str) -> None:
        # Called under the entry's lock: a temporary folder for this key is then a crashed writer's.
        for tmp in self.folder(spec).glob(f"{TMP_PREFIX}{key}-*"):
            shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _install(tmp: Path, final: Path) -> None:
        if final.exists():  # only `put` replaces a live entry; readers then miss for an instant, never see half
            old = final.with_name(f"{TMP_PREFIX}{final.name}-old-{os.getpid()}")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)

    # ------------------------------------------------------------ reading entries

    def check_entry(
        self,
        path: Path,
        spec: CacheSpec | None = None,
        key: str | None = None,
        factors: dict[str, Any] | None = None,
        mode: VerifyMode | None = None,
    ) -> tuple[Manifest | None, str | None]:
        """(manifest, None) for a sound entry, else (manifest or None, why it is damaged or stale)."""
        try:
            m = read_manifest(path)
        except ValueError as exc:
            return None, str(exc)
        if spec is not None and (m.cache, m.version) != (spec.name, spec.version):
            return m, f"stale: made for {m.cache} v{m.version}, expected {spec.name} v{spec.version}"
        if key is not None and m.key != key:
            return m, f"stale: manifest key {m.key} does not match its folder {key}"
        if factors is not None and m.factors != factors:
            changed = describe_changes(m.factors, factors)
            return m, "stale: written by glowplug {} / torch {} for other factors ({})".format(
                m.producer.glowplug, m.producer.torch, "; ".join(changed[:3]) or "same factors, other encoding"
            )
        for rel, rec in m.files.items():
            why = check_file(path / rel, rec, mode or self.verify)
            if why is not None:
                return m, why
        return m, None

    def _open(
        self, spec: CacheSpec, key: str, factors: dict[str, Any], load: Callable[[Path], T]
    ) -> tuple[bool, T | None, str | None, str | None]:
        """(found, value, damage, bundle): found with its loaded value and the bundle that brought the entry (if
        one did: the phase table notes it), or not, with why when an entry was there."""
        path = self.entry_path(spec, key)
        if not path.exists():
            return False, None, None, None
        m, bad = self.check_entry(path, spec, key, factors)
        if bad is not None:
            return False, None, bad, None
        origin = str(m.info["bundle"]) if m is not None and m.info.get("bundle") else None
        try:
            value = load(path)
        except Exception as exc:  # noqa: BLE001 - any failure to load a cached entry makes it a miss
            return (
                False,
                None,
                f"cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                None,
            )
        if refusal(self.root, path) is None:  # a read-only dir keeps its stamps: bookkeeping, not worth a warning
            try:
                os.utime(path / "manifest.json")  # last use, for `cache ls` and `prune --older-than`
            except OSError:
                pass
        return True, value, None, origin

    def probe(self, spec: CacheSpec, factors: dict[str, Any]) -> bool:
        """Whether a fetch of `factors` would most likely hit, without loading, hashing, stamping or moving
        anything: the entry is there, its manifest is this spec's for these factors and every file has its
        recorded size. For a prediction (the start-up ETA), so a damaged entry found later costs only that."""
        key = self.key(spec, factors)
        path = self.entry_path(spec, key)
        hit = self._sound_sizes(spec, key, factors)
        seen = _PROBES.get()
        if seen is not None:
            seen.append((spec.name, path, hit))
        return hit

    def present(self, spec: CacheSpec, key: str) -> bool:
        """Whether the entry `key` is there with every file at its recorded size: `probe` for a caller that knows
        the key (a recorded start) but not the factors, which it could not compute without importing torch."""
        return self._sound_sizes(spec, key, None)

    def _sound_sizes(self, spec: CacheSpec, key: str, factors: dict[str, Any] | None) -> bool:
        path = self.entry_path(spec, key)
        try:
            m = read_manifest(path)
        except ValueError:
            return False
        if (m.cache, m.version, m.key) != (spec.name, spec.version, key):
            return False
        if factors is not None and m.factors != factors:
            return False
        for rel, rec in m.files.items():
            try:
                if (path / rel).stat().st_size != rec.size:
                    return False
            except OSError:
                return False
        return True

    def entries(self, spec: CacheSpec, group: str | None = None) -> list[tuple[Path, Manifest, float]]:
        """The entries of `spec` whose manifest reads (of model `group`, if given) as (folder, manifest, last use),
        the most recently used first. Their files are not checked: `present` does that."""
        folder = self.folder(spec)
        out: list[tuple[Path, Manifest, float]] = []
        if not folder.is_dir():
            return out
        for entry in folder.iterdir():
            if entry.name.startswith(".") or not entry.is_dir():
                continue
            try:
                m = read_manifest(entry)
                used = (entry / "manifest.json").stat().st_mtime
            except (ValueError, OSError):
                continue
            if m.cache == spec.name and (group is None or m.group == group):
                out.append((entry, m, used))
        return sorted(out, key=lambda e: e[2], reverse=True)

    def latest(self, spec: CacheSpec, group: str, *, exclude: str | None = None) -> Manifest | None:
        """The most recently used readable entry of `spec` for `group` (the same model), if any."""
        return next((m for entry, m, _ in self.entries(spec, group) if entry.name != exclude), None)

    def explain(self, spec: CacheSpec, key: str, factors: dict[str, Any], group: str) -> str:
        """Why `key` is not in the cache: what changed since the last entry for the same model (old -> new)."""
        last = self.latest(spec, group, exclude=key)
        if last is None:
            return spec.first
        changes = describe_changes(last.factors, factors)
        if last.version != spec.version:
            changes.insert(0, f"{spec.name} entry format v{last.version} -> v{spec.version}")
        if not changes:
            return "entry removed since the last start (pruned or moved aside)"
        return "changed: " + "; ".join(changes) + self._bundle_origin(last)

    @staticmethod
    def _bundle_origin(last: Manifest) -> str:
        """For an entry a bundle brought (bundle.py): which machine facts differ from where it was made, which is
        usually why the factors changed (a lower ISA level turns the dtype to float32, say)."""
        origin = last.info.get("bundle")
        theirs = last.info.get("machine")
        if not origin or not isinstance(theirs, dict):
            return ""
        from glowplug.base.machine import fact_changes, machine_facts

        ours = machine_facts(compiler=False)
        ours["glowplug_source"] = theirs.get("glowplug_source", "")  # not recomputed here: the factors say it
        differ = fact_changes(theirs, ours)
        return f" (entry from bundle {origin}" + (f", made where {'; '.join(differ)})" if differ else ")")

    # ------------------------------------------------------------ the operations caches use

    def fetch(
        self,
        spec: CacheSpec,
        factors: dict[str, Any],
        *,
        group: str,
        build: Callable[[Path | None], T],
        load: Callable[[Path], T],
    ) -> Fetched[T]:
        """The entry for `factors`, loaded; built (and stored) first when missing or damaged.

        build(folder) computes the value and writes the entry's files into `folder` (a temporary folder renamed
        into place afterwards), or only computes it when `folder` is None (the cache dir is unusable).
        load(folder) reads a stored entry; if it raises, the entry counts as damaged and is rebuilt.
        """
        key = self.key(spec, factors)
        path = self.entry_path(spec, key)
        corrupt: list[str] = []
        problem = self.read_problem()
        if problem is None:
            found, value, bad, origin = self._open(spec, key, factors, load)
            if found:
                return Fetched(value, key, True, path, bundle=origin)  # type: ignore[arg-type]
        else:
            bad = None
        problem = problem or self.write_problem(spec)
        if problem is not None:
            if bad is not None:  # cannot move it aside; say so and do without it
                corrupt.append(self.leave_in_place(spec, path, bad))
            message = self.bypass(spec, problem)
            return Fetched(build(None), key, False, None, f"cache dir unusable: {problem.problem}", corrupt, message)
        try:
            with self.lock(spec, key):
                found, value, bad, origin = self._open(spec, key, factors, load)  # another process may have built it
                if found:
                    return Fetched(value, key, True, path, corrupt=corrupt, bundle=origin)  # type: ignore[arg-type]
                if bad is not None:
                    corrupt.append(self.quarantine(spec, path, bad))
                reason = f"entry was damaged ({bad}); rebuilt" if bad else self.explain(spec, key, factors, group)
                value = self._write(spec, key, factors, group, build)
                return Fetched(value, key, False, path, reason, corrupt)
        except Exception as exc:
            unusable = classify(self.root, exc)
            if unusable is None:
                raise
            message = self.bypass(spec, unusable)
            return Fetched(build(None), key, False, None, f"cache dir unusable: {unusable.problem}", corrupt, message)

    def lookup(
        self, spec: CacheSpec, factors: dict[str, Any], *, group: str, load: Callable[[Path], T]
    ) -> Fetched[T | None]:
        """Read-only fetch: the loaded entry, or value None with the miss explained (damaged entries moved aside)."""
        key = self.key(spec, factors)
        path = self.entry_path(spec, key)
        problem = self.read_problem()
        if problem is not None:
            return Fetched(None, key, False, None, f"cache dir unusable: {problem.problem}")
        found, value, bad, origin = self._open(spec, key, factors, load)
        if found:
            return Fetched(value, key, True, path, bundle=origin)
        corrupt: list[str] = []
        if bad is not None:
            if self.write_problem(spec) is None:
                with self.lock(spec, key):
                    found, value, bad, origin = self._open(spec, key, factors, load)
                    if found:
                        return Fetched(value, key, True, path, bundle=origin)
                    if bad is not None:
                        corrupt.append(self.quarantine(spec, path, bad))
            else:
                corrupt.append(self.leave_in_place(spec, path, bad))
        reason = f"entry was damaged ({bad})" if bad else self.explain(spec, key, factors, group)
        return Fetched(None, key, False, None, reason, corrupt)

    def put(
        self,
        spec: CacheSpec,
        factors: dict[str, Any],
        *,
        group: str,
        build: Callable[[Path | None], T],
        refresh: bool = False,
    ) -> Fetched[T]:
        """Write (or replace) the entry for `factors` unconditionally, e.g. a profile refreshed by every start.

        refresh: the new entry only updates a sound existing one (the start-up profile's latest timings), so when the
        cache dir cannot be written and that entry is there, the write is skipped silently (no event, no warning):
        the next start still finds an entry for these factors."""
        key = self.key(spec, factors)
        path = self.entry_path(spec, key)
        problem = self.write_problem(spec)
        if problem is not None and refresh and self.read_problem() is None and path.is_dir():
            _, bad = self.check_entry(path, spec, key, factors)
            if bad is None:
                return Fetched(build(None), key, False, path)
        if problem is None:
            try:
                corrupt = []
                with self.lock(spec, key):
                    if path.exists():  # being replaced, but a damaged one is still reported and kept aside
                        _, bad = self.check_entry(path, spec, key, factors)
                        if bad is not None:
                            corrupt.append(self.quarantine(spec, path, bad))
                    value = self._write(spec, key, factors, group, build)
                return Fetched(value, key, False, path, corrupt=corrupt)
            except Exception as exc:
                problem = classify(self.root, exc)
                if problem is None:
                    raise
        message = self.bypass(spec, problem)
        return Fetched(build(None), key, False, None, f"cache dir unusable: {problem.problem}", [], message)

    def _write(
        self, spec: CacheSpec, key: str, factors: dict[str, Any], group: str, build: Callable[[Path | None], T]
    ) -> T:
        """Build into a temporary folder, add the manifest, rename into place (the caller holds the lock)."""
        self._remove_leftovers(spec, key)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{key}-", dir=self.folder(spec)))
        try:
            value = build(tmp)
            files = {rel: record_file(tmp / rel) for rel in list_files(tmp)}
            manifest = Manifest(
                format=FORMAT,
                cache=spec.name,
                version=spec.version,
                key=key,
                group=group,
                factors=factors,
                files=files,
                created=now_iso(),
                producer=producer(),
            )
            write_manifest(tmp, manifest)
            self._install(tmp, self.entry_path(spec, key))
            return value
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
