"""Bundles: store entries carried in one file from the machine that built them to one that has not.

A bundle is an uncompressed POSIX tar (the weights are already compact; compressing them would cost more time on
install than it saves on the wire) with, in this order:

    glowplug-bundle.json          the header (BundleHeader): format, who made it where (the machine's facts), the
                                  engine config it was made for, and every entry's manifest
    glowplug-bundle.json.sha256   the header's sha256, so that a damaged header is refused rather than believed
    entries/<cache>/<key>/<file>  each entry's files, entry after entry, in the header's order

Every file of every entry carries its sha256 in that entry's manifest (manifest.py), so an install hashes what it
unpacks and installs an entry only when all of its files match. A damaged entry (a flipped byte, a file cut short,
a tar block that fails its own checksum) is a miss with a `cache_corrupt` event, like a damaged cache entry, and
the entries after a truncation are misses the same way; only a file that is not a bundle at all (or whose header is
damaged) is refused, with one line (NotABundle).

What an entry means and whether its factors hold on this machine is the caches' business, not this module's: an
installed entry whose factors do not match this machine's is simply never looked up by key, and the store's miss
explanation names what differs (store.py `explain`; installed entries carry the bundle's name and machine facts
in their manifest's `info`, so the explanation can say where they were made).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from glowplug.profiling.names import Event

from .cachedir import report_event, warn_once
from .caches import ALL, SOURCE, by_name
from .manifest import Manifest, first_error, read_manifest, write_manifest
from .store import LOCKS, TMP_PREFIX, ArtifactStore

BUNDLE_FORMAT = "glowplug-bundle/1"
HEADER = "glowplug-bundle.json"
HEADER_SUM = HEADER + ".sha256"
ENTRIES = "entries"
SUFFIX = ".glowplug"
MTIME_NS = "GLOWPLUG.mtime_ns"  # a vendor PAX record per member
_CHUNK = 1 << 22

__all__ = [
    "BUNDLE_FORMAT",
    "BundleEntry",
    "BundleHeader",
    "EntryOutcome",
    "InstallReport",
    "NotABundle",
    "install_bundle",
    "read_header",
    "write_bundle",
]


class NotABundle(ValueError):
    """The file is not a glowplug bundle, or its header is damaged; str() is one line naming the file and the fix."""


class BundleEntry(BaseModel):
    """One store entry in the bundle: its cache, key and manifest (factors, files with sha256)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cache: str
    key: str
    manifest: Manifest


class BundleHeader(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["glowplug-bundle/1"]
    created: str
    glowplug: str  # the package version that made it
    machine: dict[str, Any]  # the maker's machine facts (engine/bundle.py machine_facts)
    config: dict[str, Any]  # the engine config it was made for (flat fields as EngineConfig.model_dump gives them)
    model: dict[str, Any]  # what the model spec was, and which `source` entry carries its files (if any)
    entries: list[BundleEntry]
    info: dict[str, Any] = Field(default_factory=dict)  # timings of the starts that made it, for `bundle show`


# ---------------------------------------------------------------- writing


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    member = tarfile.TarInfo(name)
    member.size, member.mode, member.mtime = len(data), 0o644, 0
    tar.addfile(member, io.BytesIO(data))


def write_bundle(out: Path, header: BundleHeader, folders: Sequence[Path]) -> int:
    """Write the bundle: the header, then each entry's files from `folders` (one per header entry, same order).
    Written to a temporary file beside `out` and renamed, so `out` is whole or absent. Returns its size."""
    if len(folders) != len(header.entries):
        raise ValueError("one folder per bundle entry")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        text = header.model_dump_json(indent=1).encode()
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            _add_bytes(tar, HEADER, text)
            _add_bytes(tar, HEADER_SUM, hashlib.sha256(text).hexdigest().encode())
            for entry, folder in zip(header.entries, folders):
                for rel in entry.manifest.files:
                    info = tar.gettarinfo(str(folder / rel), arcname=f"{ENTRIES}/{entry.cache}/{entry.key}/{rel}")
                    # Kept as is: the model cache keys a GGUF by name, size and mtime, so a copy that keeps its
                    # mtime is still the same source (the owner is not kept; it means nothing elsewhere).
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    # tar's own mtime is a float (100 ns steps at today's dates); the key wants the exact one.
                    info.pax_headers = {MTIME_NS: str((folder / rel).stat().st_mtime_ns)}
                    with (folder / rel).open("rb") as f:
                        tar.addfile(info, f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would keep the bundle from the users a shared image serves
        os.replace(tmp, out)
        return out.stat().st_size
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------- reading


def read_header(path: Path) -> BundleHeader:
    """The bundle's header, checked against its checksum; NotABundle (one line) when the file is anything else."""
    fix = "make one with `glowplug bundle create`"
    if not path.is_file():
        raise NotABundle(f"{path} is not a file; pass a bundle made with `glowplug bundle create`")
    try:
        with tarfile.open(path, "r:") as tar:
            first, second = tar.next(), tar.next()
            if first is None or first.name != HEADER or second is None or second.name != HEADER_SUM:
                raise NotABundle(f"{path} is a tar file but not a glowplug bundle (no {HEADER} first); {fix}")
            text = tar.extractfile(first).read()  # type: ignore[union-attr]
            want = tar.extractfile(second).read().decode().strip()  # type: ignore[union-attr]
    except (tarfile.TarError, EOFError, OSError, UnicodeDecodeError) as exc:
        if isinstance(exc, NotABundle):
            raise
        raise NotABundle(f"{path} is not a glowplug bundle ({type(exc).__name__}: {exc}); {fix}") from None
    if hashlib.sha256(text).hexdigest() != want:
        raise NotABundle(
            f"{path} is a damaged glowplug bundle: its header fails its checksum; make it again "
            f"with `glowplug bundle create`"
        )
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise NotABundle(f"{path}: the bundle header is not JSON; {fix}") from None
    if isinstance(data, dict) and data.get("format") != BUNDLE_FORMAT:
        raise NotABundle(
            f"{path} is a bundle of format {data.get('format')!r}, not {BUNDLE_FORMAT!r} (made by "
            f"another glowplug version); make it again with this version's `glowplug bundle create`"
        )
    try:
        return BundleHeader.model_validate(data)
    except ValidationError as exc:
        raise NotABundle(f"{path}: the bundle header is malformed ({first_error(exc)}); {fix}") from None


# ---------------------------------------------------------------- installing


Outcome = Literal["installed", "present", "damaged", "skipped"]


@dataclass(frozen=True)
class EntryOutcome:
    cache: str
    key: str
    outcome: Outcome
    reason: str = ""


@dataclass
class InstallReport:
    """What an install did, entry by entry (in the bundle's order)."""

    bundle: Path
    header: BundleHeader
    entries: list[EntryOutcome] = field(default_factory=list)

    def count(self, outcome: Outcome) -> int:
        return sum(1 for e in self.entries if e.outcome == outcome)

    def outcome_of(self, cache: str, key: str) -> EntryOutcome | None:
        return next((e for e in self.entries if e.cache == cache and e.key == key), None)

    def summary(self) -> str:
        parts = [f"{self.count('installed')} installed", f"{self.count('present')} already in the cache"]
        if self.count("damaged"):
            parts.append(f"{self.count('damaged')} damaged (rebuilt by the start)")
        if self.count("skipped"):
            parts.append(f"{self.count('skipped')} not installed ({self.entries_of('skipped')})")
        return ", ".join(parts)

    def entries_of(self, outcome: Outcome) -> str:
        return ", ".join(sorted({e.cache for e in self.entries if e.outcome == outcome}))


def _copy_hashing(fd: int, offset: int, size: int, dst: Path) -> tuple[int, str]:
    """Copy the bundle's bytes [offset, offset + size) to `dst` and hash them; (bytes hashed, sha256).

    The kernel copies (`os.copy_file_range`: no user-space buffer, and a shared extent where the file system can
    clone) while a thread hashes the same range, so the install costs about one hash of the bundle rather than a
    read, a hash and a write in turn (hashlib and the copy both release the GIL). Raises EOFError when the bundle
    ends inside the range."""
    h = hashlib.sha256()
    hashed = 0

    def hash_range() -> None:
        nonlocal hashed
        while hashed < size:
            block = os.pread(fd, min(_CHUNK, size - hashed), offset + hashed)
            if not block:
                return
            h.update(block)
            hashed += len(block)

    hasher = threading.Thread(target=hash_range, name="bundle-hash", daemon=True)
    hasher.start()
    try:
        with dst.open("wb") as out:
            _copy_range(fd, out.fileno(), offset, size)
    finally:
        hasher.join()
    if hashed < size:
        raise EOFError(f"the bundle ends {size - hashed} bytes into a {size}-byte file")
    return hashed, h.hexdigest()


def _copy_range(src: int, dst: int, offset: int, size: int) -> None:
    """`size` bytes of `src` from `offset` appended to `dst`: in the kernel where it can, else through a buffer."""
    done = 0
    while done < size:
        try:
            n = os.copy_file_range(src, dst, size - done, offset + done)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                raise
            break  # this file system (or kernel) cannot copy between these files: copy through a buffer
        if n == 0:
            return  # the bundle ends here: the hash's count says so
        done += n
    while done < size:
        block = os.pread(src, min(_CHUNK, size - done), offset + done)
        if not block:
            return
        os.write(dst, block)
        done += len(block)


def _member_parts(name: str) -> tuple[str, str, str] | None:
    p = PurePosixPath(name)
    if len(p.parts) < 4 or p.parts[0] != ENTRIES or ".." in p.parts or p.is_absolute():
        return None
    return p.parts[1], p.parts[2], str(PurePosixPath(*p.parts[3:]))


def install_bundle(
    path: Path,
    store: ArtifactStore,
    *,
    info: dict[str, Any] | None = None,
    wanted: Callable[[BundleEntry], str | None] | None = None,
) -> InstallReport:
    """Unpack `path`'s entries into `store`, each checked file by file against its manifest's sha256.

    An entry already sound in the store is left as it is ("present"); one whose files do not match is not
    installed ("damaged", with a `cache_corrupt` event naming the bundle, the entry and the file); `wanted` may
    return a reason not to install an entry ("skipped"). Installed entries get the bundle's file name and its
    maker's machine facts in their manifest's `info` (plus `info`), so a miss can say where they came from.
    Raises NotABundle before anything is written when the file is not a bundle; never raises for a damaged
    entry, a truncated file or a cache dir that cannot be written (those entries are misses, reported)."""
    header = read_header(path)
    report = InstallReport(path, header)
    problem = store.read_problem() or store.write_problem(SOURCE)
    if problem is not None:
        # Nothing can be installed (a read-only image layer, say): the start runs without the bundle, warned
        # once, as any cache that cannot store runs without the dir.
        report_event(
            Event.CACHE_UNUSABLE,
            cache="bundle",
            path=store.root,
            reason=problem.problem,
            action=f"not installing {path.name}; the start builds what it needs",
        )
        warn_once(problem, [s.name for s in ALL if s.on_unusable == "bypass"])
        report.entries = [
            EntryOutcome(e.cache, e.key, "skipped", f"cache dir unusable: {problem.problem}") for e in header.entries
        ]
        return report
    plan: dict[tuple[str, str], BundleEntry] = {}
    for entry in header.entries:
        why_not = wanted(entry) if wanted is not None else None
        spec = _spec(entry.cache)
        if spec is None:
            report.entries.append(EntryOutcome(entry.cache, entry.key, "skipped", "a cache this version does not have"))
            continue
        if why_not:
            report.entries.append(EntryOutcome(entry.cache, entry.key, "skipped", why_not))
            continue
        folder = store.entry_path(spec, entry.key)
        if folder.is_dir():
            _, bad = store.check_entry(folder, spec, entry.key, entry.manifest.factors)
            if bad is None:
                report.entries.append(EntryOutcome(entry.cache, entry.key, "present"))
                continue
        plan[(entry.cache, entry.key)] = entry
    if plan:
        _unpack(
            path,
            store,
            plan,
            report,
            {"bundle": path.name, "bundle_created": header.created, "machine": header.machine, **(info or {})},
        )
    order = {(e.cache, e.key): i for i, e in enumerate(header.entries)}
    report.entries.sort(key=lambda e: order.get((e.cache, e.key), len(order)))
    return report


def _spec(name: str) -> Any:
    try:
        return by_name(name)
    except ValueError:
        return None


def _unpack(
    path: Path,
    store: ArtifactStore,
    plan: dict[tuple[str, str], BundleEntry],
    report: InstallReport,
    info: dict[str, Any],
) -> None:
    """One pass over the tar: each planned entry's files into a temporary folder in its cache, hashed on the way;
    a whole, matching entry gets its manifest and is renamed into place."""
    open_dirs: dict[tuple[str, str], Path] = {}
    hashes: dict[tuple[str, str], dict[str, tuple[int, str]]] = {}
    failed: dict[tuple[str, str], str] = {}
    truncated: str | None = None

    def finish(ident: tuple[str, str]) -> None:
        entry = plan.pop(ident)
        tmp = open_dirs.pop(ident, None)
        got = hashes.pop(ident, {})
        why = failed.pop(ident, None)
        if why is None:
            for rel, rec in entry.manifest.files.items():
                if rel not in got:
                    why = f"{rel} is missing from the bundle"
                    break
                size, digest = got[rel]
                if size != rec.size or digest != rec.sha256:
                    why = f"{rel}: sha256 differs from its manifest (the bundle is damaged)"
                    break
        outcome = _settle(store, entry, tmp, why, info, path)
        report.entries.append(outcome)

    try:
        with tarfile.open(path, "r:") as tar, _raw(path) as fd:
            current: tuple[str, str] | None = None
            for member in tar:
                parts = _member_parts(member.name)
                if parts is None:
                    continue
                ident, rel = (parts[0], parts[1]), parts[2]
                if current is not None and ident != current and current in plan:
                    finish(current)
                current = ident
                if ident not in plan or ident in failed:
                    continue
                if not member.isfile():
                    failed[ident] = f"{rel} is not a regular file in the bundle"
                    continue
                tmp = open_dirs.get(ident)
                if tmp is None:
                    spec = by_name(ident[0])
                    try:
                        (store.folder(spec) / LOCKS).mkdir(parents=True, exist_ok=True)
                        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{ident[1]}-", dir=store.folder(spec)))
                    except OSError as exc:
                        failed[ident] = f"cannot be written into the cache dir ({exc.strerror or exc})"
                        continue
                    open_dirs[ident] = tmp
                target = tmp / rel
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    if member.issparse():
                        raise tarfile.TarError(f"{rel} is a sparse member, which bundles never hold")
                    hashes.setdefault(ident, {})[rel] = _copy_hashing(fd, member.offset_data, member.size, target)
                    mtime = _mtime_ns(member)
                    os.utime(target, ns=(mtime, mtime))
                except (tarfile.TarError, EOFError) as exc:
                    failed[ident] = f"{rel}: the bundle ends or breaks inside it ({type(exc).__name__}: {exc})"
                    raise
                except OSError as exc:
                    failed[ident] = f"{rel} cannot be written into the cache dir ({exc.strerror or exc})"
            if current is not None and current in plan:
                finish(current)
    except (tarfile.TarError, EOFError, OSError) as exc:
        truncated = f"the bundle is cut short or damaged after this point ({type(exc).__name__}: {exc})"
    for ident in list(plan):  # never reached: the file ended (or broke) before them
        if ident not in failed:
            failed[ident] = truncated or "missing from the bundle"
        finish(ident)


@contextlib.contextmanager
def _raw(path: Path) -> Iterator[int]:
    """The bundle opened once more for positional reads and kernel copies of its members' data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)


def _mtime_ns(member: tarfile.TarInfo) -> int:
    """The member's mtime to the nanosecond, as written (the model cache keys a GGUF on its mtime_ns)."""
    exact = (member.pax_headers or {}).get(MTIME_NS, "")
    return int(exact) if exact.isdigit() else int(member.mtime * 1e9)


def _settle(
    store: ArtifactStore, entry: BundleEntry, tmp: Path | None, why: str | None, info: dict[str, Any], bundle: Path
) -> EntryOutcome:
    spec = by_name(entry.cache)
    final = store.entry_path(spec, entry.key)
    if why is None and tmp is not None:
        manifest = entry.manifest.model_copy(update={"info": {**entry.manifest.info, **info}})
        try:
            write_manifest(tmp, manifest)
            with store.lock(spec, entry.key):
                if final.exists():
                    _, bad = store.check_entry(final, spec, entry.key, entry.manifest.factors)
                    if bad is None:  # another process installed it meanwhile
                        return EntryOutcome(entry.cache, entry.key, "present")
                    store.quarantine(spec, final, bad)
                os.rename(tmp, final)
            return EntryOutcome(entry.cache, entry.key, "installed")
        except OSError as exc:
            why = f"cannot be installed into the cache dir ({exc.strerror or exc})"
    if tmp is not None and tmp.exists():  # not renamed into place: a damaged entry, or the rename failed
        shutil.rmtree(tmp, ignore_errors=True)
    why = why or "nothing of it could be read"
    report_event(
        Event.CACHE_CORRUPT,
        cache=entry.cache,
        path=bundle,
        reason=f"bundle entry {entry.key}: {why}",
        action="not installed; the start rebuilds it",
    )
    return EntryOutcome(entry.cache, entry.key, "damaged", why)


def entry_folders(store: ArtifactStore) -> Iterator[tuple[str, str, Path, Manifest]]:
    """Every sound-looking entry in `store` (cache, key, folder, manifest), for `bundle create`."""
    for spec in ALL:
        folder = store.folder(spec)
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if path.name.startswith(".") or not path.is_dir():
                continue
            try:
                m = read_manifest(path)
            except ValueError:  # an entry being written, or a damaged one: not worth carrying
                continue
            yield spec.name, path.name, path, m
