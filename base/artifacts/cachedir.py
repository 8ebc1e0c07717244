"""The cache dir itself: why it cannot be used (a file, read-only, a full disk), said in one line naming
GLOWPLUG_CACHE_DIR and the fix, and the cache events every store operation reports on the current span."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Any

from glowplug.profiling.names import Attr, Event

DEFAULT_CACHE_DIR = "~/.cache/glowplug"


def cache_dir_from_env() -> Path:
    """`GLOWPLUG_CACHE_DIR` wins; the default lives under the user's cache."""
    return Path(os.environ.get("GLOWPLUG_CACHE_DIR") or DEFAULT_CACHE_DIR).expanduser()


FIX_FOLDER = "point GLOWPLUG_CACHE_DIR at a writable folder (default ~/.cache/glowplug)"
_WARNED: set[str] = set()  # one warning per process and problem, however many caches meet it


class CacheDirUnusable(OSError):
    """GLOWPLUG_CACHE_DIR cannot be used; str() is one line naming the variable, the problem and the fix."""

    def __init__(self, root: Path, problem: str, fix: str = FIX_FOLDER) -> None:
        self.root, self.problem, self.fix = root, problem, fix
        super().__init__(f"GLOWPLUG_CACHE_DIR={root} {problem}; fix: {fix}")

    def __str__(self) -> str:
        return str(self.args[0])


def log() -> Any:
    """The artifacts' logger. structlog and OpenTelemetry are imported when a store first reports something, not
    with the store: `glowplug startup --predict-only` and `glowplug cache ls` read the store and must stay fast."""
    import structlog

    return structlog.get_logger("glowplug.artifacts")


def report_event(event: str, *, cache: str, path: Path, reason: str, action: str) -> None:
    """Put a cache event on the current span (the running stage's) and log it."""
    from opentelemetry import trace

    attrs = {Attr.CACHE_NAME: cache, Attr.CACHE_PATH: str(path), Attr.CACHE_REASON: reason, Attr.CACHE_ACTION: action}
    trace.get_current_span().add_event(event, attrs)
    if event == Event.CACHE_CORRUPT:
        log().warning(f"{cache} cache entry is damaged: {reason}; {action}", path=str(path), cache=cache)


def warn_once(problem: CacheDirUnusable, bypassing: list[str]) -> None:
    """One warning line per process and problem; each stage's span still records its own event."""
    if str(problem) in _WARNED:
        return
    _WARNED.add(str(problem))
    log().warning(
        f"{problem}. Meanwhile glowplug runs without caching ({', '.join(bypassing)}: recomputed on every start)"
    )


def read_problem(root: Path) -> CacheDirUnusable | None:
    """Why nothing can even be read from the root (it is not a folder), else None."""
    if root.exists() and not root.is_dir():
        return CacheDirUnusable(root, "is a file, not a folder", f"{FIX_FOLDER}, or move the file away")
    return None


def _nearest_existing(root: Path, folder: Path) -> Path | None:
    """`folder`, or its closest ancestor up to `root` that exists; None when not even `root` does."""
    for p in (folder, *folder.parents):
        if p.exists():
            return p
        if p == root:
            break
    return None


def refusal(root: Path, folder: Path) -> CacheDirUnusable | None:
    """Why the kernel would refuse a write into `folder` under `root`, asked without writing anything (access(2) and
    statvfs(2)), else None. A read-only mount (a container image layer, a shared mount) is refused here even for
    root, whose access(2) ignores modes but not EROFS; a cache that only reads its hits must not try a write to find
    out, so this is what the store asks before any bookkeeping write on a hit."""
    existing = _nearest_existing(root, folder)
    if existing is None or os.access(existing, os.W_OK):
        return None
    ro = os.statvfs(existing).f_flag & os.ST_RDONLY
    return CacheDirUnusable(
        root, f"is read-only ({os.strerror(errno.EROFS if ro else errno.EACCES)})", f"make it writable or {FIX_FOLDER}"
    )


def write_problem(root: Path, folder: Path) -> CacheDirUnusable | None:
    """Why nothing can be written into `folder` under `root`, else None: first asked without writing (`refusal`),
    then checked by really creating a file (a full disk, say, only shows that way)."""
    problem = read_problem(root) or refusal(root, folder)
    if problem is not None:
        return problem
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return classify(root, exc) or CacheDirUnusable(root, f"cannot be written ({exc.strerror})")
    return None


def _disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # safetensors and torch wrap the OS error in their own exception types; the text is what survives.
    text = str(exc)
    return "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text


def _inside(root: Path, exc: OSError) -> bool:
    # A permission error on some other file (the model's own folder, say) is not the cache dir's problem.
    name = exc.filename if isinstance(exc.filename, str) else None
    return name is not None and os.path.abspath(name).startswith(os.path.abspath(root))


def classify(root: Path, exc: BaseException) -> CacheDirUnusable | None:
    """The cache-dir problem behind an error raised while writing an entry, or None when it is something else."""
    if _disk_full(exc):
        return CacheDirUnusable(
            root,
            "is on a full disk (no space left)",
            f"free space (`glowplug cache prune --older-than 7d`) or {FIX_FOLDER} on a disk with room",
        )
    if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and _inside(root, exc):
        return CacheDirUnusable(root, f"is read-only ({exc.strerror})", f"make it writable or {FIX_FOLDER}")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return read_problem(root)
    return None
