"""A GGUF file's scalar metadata, read straight from its header in milliseconds, without numpy or `gguf`.

Preparing a GGUF (store.py) parses everything, the vocabulary included, which takes seconds; checking a setting
against the model (its positions, its shapes) or reading its sampling defaults needs only a handful of scalars.
This reader walks the key/value section once and skips arrays by their lengths, so the CLI can refuse
`--max-model-len 999999` within a second of starting, before any heavy import or conversion.

Format (little-endian, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic `GGUF`, uint32 version,
then (version >= 2) uint64 tensor count and uint64 key/value count; each key/value is a string key (uint64 length
+ UTF-8), a uint32 type and the value; an array is a uint32 item type, a uint64 count and the items.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import IO, Any

from .arch import ModelError

_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
    7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}  # fmt: skip
_STRING, _ARRAY = 8, 9


def _read(f: IO[bytes], fmt: str, size: int) -> Any:
    data = f.read(size)
    if len(data) != size:
        raise EOFError("the file ends inside its metadata")
    return struct.unpack(fmt, data)[0]


def _string(f: IO[bytes]) -> str:
    n = _read(f, "<Q", 8)
    data = f.read(n)
    if len(data) != n:
        raise EOFError("the file ends inside a string")
    return data.decode("utf-8", errors="replace")


def _skip_items(f: IO[bytes], kind: int, count: int) -> None:
    if kind == _STRING:
        for _ in range(count):
            f.seek(_read(f, "<Q", 8), 1)
    elif kind in _SCALARS:
        f.seek(_SCALARS[kind][1] * count, 1)
    elif kind == _ARRAY:
        for _ in range(count):
            _skip_items(f, _read(f, "<I", 4), _read(f, "<Q", 8))
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


def read_gguf_metadata(path: Path, stop_at: str | None = None) -> dict[str, Any]:
    """Every scalar key of the file's metadata (numbers, booleans, strings). An array is given as a `range` of its
    length (`len(meta["tokenizer.ggml.tokens"])` is the vocabulary size) rather than read.

    stop_at: return once this key is read (the keys before it included): `general.architecture` comes first in
    llama.cpp's files, so checking it costs one small read, not a walk past a 262k-token vocabulary (~0.1 s)."""
    out: dict[str, Any] = {}
    try:
        with open(path, "rb", buffering=1 << 16) as f:
            if f.read(4) != b"GGUF":
                raise ValueError("no GGUF magic at the start")
            version = _read(f, "<I", 4)
            if version == 1:  # v1 counted in uint32
                _read(f, "<I", 4)
                count = _read(f, "<I", 4)
            elif 2 <= version <= 3:
                _read(f, "<Q", 8)
                count = _read(f, "<Q", 8)
            else:
                raise ValueError(f"GGUF version {version} is not one this reader knows (1 to 3)")
            for _ in range(count):
                key = _string(f)
                kind = _read(f, "<I", 4)
                if kind == _STRING:
                    out[key] = _string(f)
                elif kind == _ARRAY:
                    item, n = _read(f, "<I", 4), _read(f, "<Q", 8)
                    _skip_items(f, item, n)
                    out[key] = range(n)
                elif kind in _SCALARS:
                    out[key] = _read(f, *_SCALARS[kind])
                else:
                    raise ValueError(f"unknown GGUF value type {kind} for {key!r}")
                if key == stop_at:
                    break
    except (OSError, EOFError, ValueError, struct.error) as exc:
        raise ModelError(f"{path}: not a readable GGUF file ({exc}); re-download or re-export it") from exc
    return out


class _Field:
    """The one method of a `gguf.ReaderField` that gguf_meta.build_config calls."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def contents(self) -> Any:
        return self._value


class HeaderReader:
    """The header's metadata behind the `fields` mapping of a `gguf.GGUFReader`, so gguf_meta.build_config turns
    it into the same config.json the prepared folder holds (one mapping, two readers)."""

    def __init__(self, path: Path) -> None:
        self.fields = {k: _Field(v) for k, v in read_gguf_metadata(path).items()}
