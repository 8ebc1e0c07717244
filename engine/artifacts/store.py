"""The artifact store: every cache of glowplug keeps its entries here, with one key, manifest and failure behaviour.

Layout under the cache root (GLOWPLUG_CACHE_DIR):
    <cache>/<key>/            one entry: its files and manifest.json (written last, inside the temporary folder)
    <cache>/.locks/<key>.lock the lock writers of that entry take
    <cache>/.tmp-<key>-*      an entry being written; renamed to <cache>/<key> when complete
    .quarantine/<cache>-<key>-<time>   entries (or workspace files) that failed verification, moved aside

Entries are immutable once renamed into place, so readers take no lock: a reader sees a whole entry or none.
A workspace (`workspace`/`seal`) is the one exception: a folder another tool fills in place (Inductor's cache),
verified against the manifest of the files it held when last sealed.

Failures never stop a start: an entry that fails verification or whose `load` raises is moved aside, reported as
a `cache_corrupt` event on the current span (the stage's) and rebuilt. When the cache dir cannot be written
(a file, read-only, disk full), a cache declared `bypass` builds without storing and warns once; one declared
`fail` raises CacheDirUnusable, one line naming GLOWPLUG_CACHE_DIR and the fix.
"""

from __future__ import annotations

import atexit
import errno
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
from typing import Any, Generic, Literal, TypeVar

import structlog
from filelock import FileLock, Timeout
from opentelemetry import trace

from ...profiling.names import Attr, Event
from ..config import cache_dir_from_env
from .manifest import (
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
log = structlog.get_logger("glowplug.artifacts")

QUARANTINE = ".quarantine"
LOCKS = ".locks"
TMP_PREFIX = ".tmp-"
KEEP_QUARANTINED = 2  # per cache: enough to look at what went wrong, bounded so a flapping disk cannot fill up
FIRST_START = "first start for this model"

FIX_FOLDER = "point GLOWPLUG_CACHE_DIR at a writable folder (default ~/.cache/glowplug)"
_WARNED: set[str] = set()  # one warning per process and problem, however many caches meet it


@dataclass(frozen=True)
class CacheSpec:
    """One cache: its folder name, entry format version, and what a start does when the cache dir is unusable.

    version: bump when what an entry holds changes meaning; older entries then become misses, explained.
    on_unusable: "bypass" builds without storing (with a warning); "fail" raises CacheDirUnusable.
    without: what running without this cache costs, for the warning and `glowplug cache ls`.
    """

    name: str
    version: int
    holds: str
    on_unusable: Literal["bypass", "fail"]
    without: str
    first: str = FIRST_START  # the miss reason when no entry for the same model was ever made


class CacheDirUnusable(OSError):
    """GLOWPLUG_CACHE_DIR cannot be used; str() is one line naming the variable, the problem and the fix."""

    def __init__(self, root: Path, problem: str, fix: str = FIX_FOLDER) -> None:
        self.root, self.problem, self.fix = root, problem, fix
        super().__init__(f"GLOWPLUG_CACHE_DIR={root} {problem}; fix: {fix}")

    def __str__(self) -> str:
        return str(self.args[0])


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

    def attributes(self) -> dict[str, Any]:
        """The stage-span attributes every cache reports the same way."""
        attrs: dict[str, Any] = {Attr.CACHE_HIT: self.hit, Attr.CACHE_KEY: self.key}
        if not self.hit and self.miss_reason:
            attrs[Attr.CACHE_MISS_REASON] = self.miss_reason
        return attrs


@dataclass
class Workspace:
    """A folder another tool writes in place (see module docstring). persistent=False: a private temporary
    folder used because the cache dir is unusable; nothing in it outlives the process's use of it."""

    spec: CacheSpec
    key: str
    path: Path
    group: str
    factors: dict[str, Any]
    persistent: bool
    healed: list[str] = field(default_factory=list)


def report_event(event: str, *, cache: str, path: Path, reason: str, action: str) -> None:
    """Put a cache event on the current span (the running stage's) and log it."""
    attrs = {Attr.CACHE_NAME: cache, Attr.CACHE_PATH: str(path), Attr.CACHE_REASON: reason, Attr.CACHE_ACTION: action}
    trace.get_current_span().add_event(event, attrs)
    if event == Event.CACHE_CORRUPT:
        log.warning(f"{cache} cache entry is damaged: {reason}; {action}", path=str(path), cache=cache)


def _disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # safetensors and torch wrap the OS error in their own exception types; the text is what survives.
    text = str(exc)
    return "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text


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
        """Why nothing can even be read from the root (it is not a folder), else None."""
        if self.root.exists() and not self.root.is_dir():
            return CacheDirUnusable(self.root, "is a file, not a folder", f"{FIX_FOLDER}, or move the file away")
        return None

    def write_problem(self, spec: CacheSpec) -> CacheDirUnusable | None:
        """Why `spec`'s entries cannot be written (checked by really creating a file), else None."""
        problem = self.read_problem()
        if problem is not None:
            return problem
        try:
            locks = self.folder(spec) / LOCKS
            locks.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=locks, prefix=".probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            return self._as_unusable(exc) or CacheDirUnusable(self.root, f"cannot be written ({exc.strerror})")
        return None

    def _as_unusable(self, exc: BaseException) -> CacheDirUnusable | None:
        if _disk_full(exc):
            return CacheDirUnusable(
                self.root,
                "is on a full disk (no space left)",
                f"free space (`glowplug cache prune --older-than 7d`) or {FIX_FOLDER} on a disk with room",
            )
        if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and self._inside(exc):
            return CacheDirUnusable(self.root, f"is read-only ({exc.strerror})", f"make it writable or {FIX_FOLDER}")
        if isinstance(exc, OSError) and exc.errno in (errno.ENOTDIR, errno.EEXIST) and self.read_problem():
            return self.read_problem()
        return None

    def _inside(self, exc: OSError) -> bool:
        # A permission error on some other file (the model's own folder, say) is not the cache dir's problem.
        name = exc.filename if isinstance(exc.filename, str) else None
        return name is not None and os.path.abspath(name).startswith(os.path.abspath(self.root))

    def _bypass(self, spec: CacheSpec, problem: CacheDirUnusable) -> str:
        """Say (once per process) that `spec` runs without storing; raise instead when it must not."""
        if spec.on_unusable == "fail":
            raise problem
        message = f"{problem}. Running without the {spec.name} cache: {spec.without}"
        report_event(Event.CACHE_UNUSABLE, cache=spec.name, path=self.root, reason=problem.problem,
                     action=f"running without the {spec.name} cache")  # fmt: skip
        if str(problem) not in _WARNED:  # one line per process; each stage's span still records its own event
            _WARNED.add(str(problem))
            from .caches import ALL

            skipped = ", ".join(s.name for s in ALL if s.on_unusable == "bypass")
            log.warning(f"{problem}. Meanwhile glowplug runs without caching ({skipped}: recomputed on every start)")
        return message

    # ------------------------------------------------------------ locking, quarantine, install

    @contextmanager
    def _lock(self, spec: CacheSpec, key: str) -> Iterator[None]:
        lock = FileLock(str(self.folder(spec) / LOCKS / f"{key}.lock"))
        try:
            lock.acquire(timeout=2)
        except Timeout:
            log.info(f"waiting for another glowplug process to finish {spec.name} entry {key}")
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

    def quarantine(self, spec: CacheSpec, path: Path, reason: str, *, report: bool = True) -> str:
        """Move a damaged entry (or file) aside, report it (unless the caller reports a batch), and return the
        one-line reason."""
        dest = self.root / QUARANTINE / f"{spec.name}-{path.name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
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

    def check_entry(self, path: Path, spec: CacheSpec | None = None, key: str | None = None,
                    factors: dict[str, Any] | None = None, mode: VerifyMode | None = None) -> tuple[Manifest | None, str | None]:  # fmt: skip
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

    def _open(self, spec: CacheSpec, key: str, factors: dict[str, Any], load: Callable[[Path], T]
              ) -> tuple[bool, T | None, str | None]:  # fmt: skip
        """(found, value, damage): found with its loaded value, or not, with why when an entry was there."""
        path = self.entry_path(spec, key)
        if not path.exists():
            return False, None, None
        _, bad = self.check_entry(path, spec, key, factors)
        if bad is not None:
            return False, None, bad
        try:
            value = load(path)
        except Exception as exc:  # noqa: BLE001 - any failure to load a cached entry makes it a miss
            return False, None, f"cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        try:
            os.utime(path / "manifest.json")  # last use, for `cache ls` and `prune --older-than`
        except OSError:
            pass
        return True, value, None

    def latest(self, spec: CacheSpec, group: str, *, exclude: str | None = None) -> Manifest | None:
        """The most recently used readable entry of `spec` for `group` (the same model), if any."""
        best: tuple[float, Manifest] | None = None
        folder = self.folder(spec)
        if not folder.is_dir():
            return None
        for entry in folder.iterdir():
            if entry.name.startswith(".") or entry.name == exclude or not entry.is_dir():
                continue
            try:
                m = read_manifest(entry)
                used = (entry / "manifest.json").stat().st_mtime
            except (ValueError, OSError):
                continue
            if m.cache == spec.name and m.group == group and (best is None or used > best[0]):
                best = (used, m)
        return best[1] if best else None

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
        return "changed: " + "; ".join(changes)

    # ------------------------------------------------------------ the operations caches use

    def fetch(self, spec: CacheSpec, factors: dict[str, Any], *, group: str,
              build: Callable[[Path | None], T], load: Callable[[Path], T]) -> Fetched[T]:  # fmt: skip
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
            found, value, bad = self._open(spec, key, factors, load)
            if found:
                return Fetched(value, key, True, path)  # type: ignore[arg-type]
        else:
            bad = None
        problem = problem or self.write_problem(spec)
        if problem is not None:
            if bad is not None:  # cannot move it aside; say so and do without it
                report_event(Event.CACHE_CORRUPT, cache=spec.name, path=path, reason=bad,
                             action="left in place (the cache dir is unusable); not using it")  # fmt: skip
                corrupt.append(f"{spec.name} {key}: {bad}")
            message = self._bypass(spec, problem)
            return Fetched(build(None), key, False, None, f"cache dir unusable: {problem.problem}", corrupt, message)
        try:
            with self._lock(spec, key):
                found, value, bad = self._open(spec, key, factors, load)  # another process may have built it
                if found:
                    return Fetched(value, key, True, path, corrupt=corrupt)  # type: ignore[arg-type]
                if bad is not None:
                    corrupt.append(self.quarantine(spec, path, bad))
                reason = f"entry was damaged ({bad}); rebuilt" if bad else self.explain(spec, key, factors, group)
                value = self._write(spec, key, factors, group, build)
                return Fetched(value, key, False, path, reason, corrupt)
        except Exception as exc:
            unusable = self._as_unusable(exc)
            if unusable is None:
                raise
            message = self._bypass(spec, unusable)
            return Fetched(build(None), key, False, None, f"cache dir unusable: {unusable.problem}", corrupt, message)

    def lookup(self, spec: CacheSpec, factors: dict[str, Any], *, group: str,
               load: Callable[[Path], T]) -> Fetched[T | None]:  # fmt: skip
        """Read-only fetch: the loaded entry, or value None with the miss explained (damaged entries moved aside)."""
        key = self.key(spec, factors)
        path = self.entry_path(spec, key)
        problem = self.read_problem()
        if problem is not None:
            return Fetched(None, key, False, None, f"cache dir unusable: {problem.problem}")
        found, value, bad = self._open(spec, key, factors, load)
        if found:
            return Fetched(value, key, True, path)
        corrupt: list[str] = []
        if bad is not None:
            if self.write_problem(spec) is None:
                with self._lock(spec, key):
                    found, value, bad = self._open(spec, key, factors, load)
                    if found:
                        return Fetched(value, key, True, path)
                    if bad is not None:
                        corrupt.append(self.quarantine(spec, path, bad))
            else:
                report_event(Event.CACHE_CORRUPT, cache=spec.name, path=path, reason=bad,
                             action="left in place (the cache dir is unusable); not using it")  # fmt: skip
                corrupt.append(f"{spec.name} {key}: {bad}")
        reason = f"entry was damaged ({bad})" if bad else self.explain(spec, key, factors, group)
        return Fetched(None, key, False, None, reason, corrupt)

    def put(self, spec: CacheSpec, factors: dict[str, Any], *, group: str,
            build: Callable[[Path | None], T]) -> Fetched[T]:  # fmt: skip
        """Write (or replace) the entry for `factors` unconditionally, e.g. a profile refreshed by every start."""
        key = self.key(spec, factors)
        path = self.entry_path(spec, key)
        problem = self.write_problem(spec)
        if problem is None:
            try:
                corrupt = []
                with self._lock(spec, key):
                    if path.exists():  # being replaced, but a damaged one is still reported and kept aside
                        _, bad = self.check_entry(path, spec, key, factors)
                        if bad is not None:
                            corrupt.append(self.quarantine(spec, path, bad))
                    value = self._write(spec, key, factors, group, build)
                return Fetched(value, key, False, path, corrupt=corrupt)
            except Exception as exc:
                problem = self._as_unusable(exc)
                if problem is None:
                    raise
        message = self._bypass(spec, problem)
        return Fetched(build(None), key, False, None, f"cache dir unusable: {problem.problem}", [], message)

    def _write(self, spec: CacheSpec, key: str, factors: dict[str, Any], group: str,
               build: Callable[[Path | None], T]) -> T:  # fmt: skip
        """Build into a temporary folder, add the manifest, rename into place (the caller holds the lock)."""
        self._remove_leftovers(spec, key)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{key}-", dir=self.folder(spec)))
        try:
            value = build(tmp)
            files = {rel: record_file(tmp / rel) for rel in list_files(tmp)}
            manifest = Manifest(format="glowplug-artifact/1", cache=spec.name, version=spec.version, key=key,
                                group=group, factors=factors, files=files, created=now_iso(), producer=producer())  # fmt: skip
            write_manifest(tmp, manifest)
            self._install(tmp, self.entry_path(spec, key))
            return value
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------ workspaces

    def _private_workspace(self, spec: CacheSpec, key: str, factors: dict[str, Any], group: str) -> Workspace:
        path = Path(tempfile.mkdtemp(prefix=f"glowplug-{spec.name}-"))
        atexit.register(shutil.rmtree, path, True)  # "without caching": nothing is left behind
        return Workspace(spec, key, path, group, factors, False)

    def workspace(self, spec: CacheSpec, factors: dict[str, Any], *, group: str) -> Workspace:
        """The verified in-place folder for `factors`: files that fail their check are moved aside (one event
        each), a workspace whose manifest is damaged or stale is moved aside whole; unusable dir -> a temp one."""
        key = self.key(spec, factors)
        path = self.entry_path(spec, key)
        problem = self.write_problem(spec)
        if problem is not None:
            self._bypass(spec, problem)
            return self._private_workspace(spec, key, factors, group)
        ws = Workspace(spec, key, path, group, factors, True)
        try:
            with self._lock(spec, key):
                if path.is_dir():
                    self._heal(ws)
                path.mkdir(parents=True, exist_ok=True)
        except Exception as exc:
            unusable = self._as_unusable(exc)
            if unusable is None:
                raise
            self._bypass(spec, unusable)
            return self._private_workspace(spec, key, factors, group)
        return ws

    def _heal(self, ws: Workspace) -> None:
        try:
            m = read_manifest(ws.path)
        except ValueError as exc:
            if str(exc).startswith("no manifest"):
                return  # never sealed yet (its first fill may be running in another process): nothing to check
            ws.healed.append(self.quarantine(ws.spec, ws.path, str(exc)))
            return
        if (m.cache, m.version, m.key, m.factors) != (ws.spec.name, ws.spec.version, ws.key, ws.factors):
            ws.healed.append(self.quarantine(ws.spec, ws.path, f"stale: written by glowplug {m.producer.glowplug} "
                                             f"/ torch {m.producer.torch} for other factors"))  # fmt: skip
            return
        kept = dict(m.files)
        bad: list[str] = []
        for rel, rec in m.files.items():
            why = check_file(ws.path / rel, rec, self.verify)
            if why is None:
                continue
            del kept[rel]
            bad.append(why)
            if (ws.path / rel).exists():
                self.quarantine(ws.spec, ws.path / rel, why, report=False)
        if bad:
            # One event for the lot: a damaged cache tends to be damaged in many files at once.
            more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
            reason = f"{len(bad)} of {len(m.files)} files damaged: {bad[0]}{more}"
            report_event(Event.CACHE_CORRUPT, cache=ws.spec.name, path=ws.path, reason=reason,
                         action=f"damaged files moved to {self.root / QUARANTINE}; rebuilt on demand")  # fmt: skip
            ws.healed.append(f"{ws.spec.name}: {reason}")
            write_manifest(ws.path, m.model_copy(update={"files": kept}))

    def renew(self, ws: Workspace, reason: str) -> Workspace:
        """Move the whole workspace aside (reported) and start an empty one at the same place."""
        if not ws.persistent:
            shutil.rmtree(ws.path, ignore_errors=True)
            ws.path.mkdir(parents=True)
            return ws
        with self._lock(ws.spec, ws.key):
            if ws.path.exists():
                ws.healed.append(self.quarantine(ws.spec, ws.path, reason))
            ws.path.mkdir(parents=True, exist_ok=True)
        return ws

    def seal(self, ws: Workspace, *, skip: tuple[str, ...] = ()) -> None:
        """Record the workspace's current files (re-hashing only new or changed ones) in its manifest."""
        if not ws.persistent:
            return
        try:
            with self._lock(ws.spec, ws.key):
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
                manifest = Manifest(format="glowplug-artifact/1", cache=ws.spec.name, version=ws.spec.version,
                                    key=ws.key, group=ws.group, factors=ws.factors, files=files, created=now_iso(),
                                    producer=producer())  # fmt: skip
                write_manifest(ws.path, manifest)
        except OSError as exc:
            unusable = self._as_unusable(exc)
            if unusable is None:
                raise
            self._bypass(ws.spec, unusable)
