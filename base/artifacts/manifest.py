"""An artifact entry's manifest: its factors, its files with sizes and checksums, who wrote it; and the checks.

Checksums (measured on the real SmolLM2 files: the figures are in `engine/artifacts/__init__.py`): a warm hit
checks every file's size, hashes small files whole, and for a large file hashes only what a cheap read can cover:
the header of a safetensors file (8-byte length + JSON: every tensor's name, dtype, shape and offsets), else the
first and last MiB. `full` verification hashes every byte of every file (sha256), which is what the manifest also
records, so `glowplug cache verify --full` or GLOWPLUG_CACHE_VERIFY=full catch a flipped bit anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

FORMAT = "glowplug-artifact/1"
MANIFEST = "manifest.json"
VerifyMode = Literal["quick", "full"]
VERIFY_ENV = "GLOWPLUG_CACHE_VERIFY"

# Files up to this size are hashed whole even on a quick check: 8 MiB hash in ~5 ms here, so every JSON, tokenizer
# file, Inductor kernel and tiny test checkpoint is covered byte for byte at no noticeable cost.
WHOLE_HASH_LIMIT = 8 << 20
_EDGE = 1 << 20  # head + tail sampled from a large file that is not safetensors
_CHUNK = 1 << 22


class FileRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    size: int = Field(ge=0)
    quick: str
    sha256: str
    mtime_ns: int | None = None  # workspaces only: lets a re-seal skip re-hashing unchanged files


class Producer(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    glowplug: str
    torch: str
    python: str
    host: str
    pid: int


class Manifest(BaseModel):
    """What `manifest.json` holds. Parsing it through this model is the first check of an entry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["glowplug-artifact/1"]
    cache: str
    version: int
    key: str
    group: str
    factors: dict[str, Any]
    files: dict[str, FileRecord]
    created: str
    producer: Producer
    info: dict[str, Any] = Field(default_factory=dict)


def package_version(name: str) -> str:
    from importlib import metadata  # imported by a writer: importlib.metadata costs a reader tens of ms

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def producer() -> Producer:
    # Package metadata, not `import torch`: `glowplug cache ls` must stay fast. `platform` for a writer alone too.
    import platform

    return Producer(
        glowplug=package_version("glowplug"),
        torch=package_version("torch"),
        python=platform.python_version(),
        host=platform.node(),
        pid=os.getpid(),
    )


def verify_mode_from_env() -> VerifyMode:
    raw = os.environ.get(VERIFY_ENV, "quick").strip().lower() or "quick"
    try:
        return TypeAdapter(VerifyMode).validate_python(raw)  # type: ignore[no-any-return]
    except ValidationError:
        raise ValueError(f"{VERIFY_ENV}={raw!r} is not a verify mode; use quick (default) or full") from None


# ---------------------------------------------------------------- checksums


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def quick_digest(path: Path, size: int) -> str:
    """The cheap checksum of one file (see module docstring); `kind:hex` so a reader knows what was hashed."""
    if size <= WHOLE_HASH_LIMIT:
        return "sha256:" + sha256_file(path)
    with path.open("rb") as f:
        if path.suffix == ".safetensors":
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (size,)
            if n > size - 8:
                return f"st-header:bad-length-{n}"
            return "st-header:" + hashlib.sha256(head + f.read(n)).hexdigest()
        h = hashlib.sha256(f.read(_EDGE))
        f.seek(max(size - _EDGE, 0))
        h.update(f.read(_EDGE))
        return "head-tail:" + h.hexdigest()


def record_file(path: Path, *, with_mtime: bool = False) -> FileRecord:
    st = path.stat()
    return FileRecord(
        size=st.st_size,
        quick=quick_digest(path, st.st_size),
        sha256=sha256_file(path),
        mtime_ns=st.st_mtime_ns if with_mtime else None,
    )


def check_file(path: Path, rec: FileRecord, mode: VerifyMode) -> str | None:
    """Why `path` does not match its record, or None when it does."""
    name = path.name
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as exc:
        return f"{name} cannot be read ({exc.strerror})"
    if not path.is_file():
        return f"{name} is not a file"
    if st.st_size != rec.size:
        what = "empty" if st.st_size == 0 else "truncated" if st.st_size < rec.size else "longer than recorded"
        return f"{name} is {st.st_size} bytes, the manifest says {rec.size} ({what})"
    try:
        if mode == "full":
            if sha256_file(path) != rec.sha256:
                return f"{name}: sha256 differs from the manifest (content changed)"
        elif quick_digest(path, st.st_size) != rec.quick:
            return f"{name}: checksum differs from the manifest ({rec.quick.split(':', 1)[0]})"
    except OSError as exc:
        return f"{name} cannot be read ({exc.strerror})"
    return None


# ---------------------------------------------------------------- reading and writing


def read_manifest(folder: Path) -> Manifest:
    """Parse `folder/manifest.json`; raises ValueError with a short reason when it is missing or not ours."""
    path = folder / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError("no manifest (an interrupted write or not made by this store)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"manifest unreadable ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"manifest is not JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(data, dict) and data.get("format") not in (None, FORMAT):
        raise ValueError(f"manifest format {data.get('format')!r} is not {FORMAT!r} (another glowplug version)")
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"manifest is malformed ({first_error(exc)})") from None


def first_error(exc: ValidationError) -> str:
    """`where: what` of a validation error's first problem, for a one-line message."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "top level"
    return f"{where}: {first['msg']}"


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Write through a temporary file and rename, so a reader sees the old manifest or the new one, never half."""
    tmp = folder / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(manifest.model_dump_json(indent=1), encoding="utf-8")
    os.replace(tmp, folder / MANIFEST)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def list_files(folder: Path, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Relative paths of the regular files under `folder` (the manifest and `skip` prefixes excluded), sorted."""
    out = []
    for dirpath, _dirs, names in os.walk(folder):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), folder)
            if rel == MANIFEST or rel.startswith(f".{MANIFEST}") or rel.startswith(skip):
                continue
            if os.path.isfile(os.path.join(dirpath, n)) and not os.path.islink(os.path.join(dirpath, n)):
                out.append(rel)
    return sorted(out)


# ---------------------------------------------------------------- explaining misses


def flatten(factors: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"engine_config": {"cache": {"block_size": 16}}}` -> `{"engine_config.cache.block_size": 16}`."""
    out: dict[str, Any] = {}
    for k, v in factors.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, (list, dict)) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def describe_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One `name old -> new` per factor (down to the nested field) that differs between two factor sets."""
    a, b = flatten(old), flatten(new)
    out = []
    for name in sorted(a.keys() | b.keys()):
        if name not in a:
            out.append(f"{name} added ({_show(b[name])})")
        elif name not in b:
            out.append(f"{name} removed (was {_show(a[name])})")
        elif a[name] != b[name]:
            out.append(f"{name} {_show(a[name])} -> {_show(b[name])}")
    return out
