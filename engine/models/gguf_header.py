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

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .arch import ModelError

_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
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


_NUMPY: dict[int, str] = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the file's tensor table, with the attribute names of `gguf.ReaderTensor` that
    gguf_tensors.read_table reads."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType (an IntEnum; an unknown type stays a plain int)
    shape: tuple[int, ...]  # as the file stores it: innermost dimension first
    data_offset: int  # from the start of the file
    n_bytes: int


class _Cursor:
    """Reads values off a mapped file at a moving offset (struct.unpack_from: no copies, no per-value reads)."""

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.at = 0

    def scalar(self, fmt: str, size: int) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.at)[0]
        self.at += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q", 8)
        end = self.at + n
        if end > len(self.buf):
            raise EOFError("the file ends inside a string")
        text = bytes(self.buf[self.at : end]).decode("utf-8", errors="replace")
        self.at = end
        return text

    def strings(self, count: int) -> list[str]:
        # The hot loop of a 262k-token vocabulary: locals only, one unpack and one slice per string.
        buf, at, unpack, out = self.buf, self.at, struct.Struct("<Q").unpack_from, []  # type: ignore[var-annotated]
        append = out.append
        for _ in range(count):
            (n,) = unpack(buf, at)
            at += 8
            append(str(buf[at : at + n], "utf-8", "replace"))
            at += n
        if at > len(buf):
            raise EOFError("the file ends inside a string array")
        self.at = at
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I", 4), self.scalar("<Q", 8)
            if item == _STRING:
                return self.strings(count)
            if item in _NUMPY:
                import numpy as np

                size = _SCALARS[item][1] * count
                if self.at + size > len(self.buf):
                    raise EOFError("the file ends inside an array")
                values = np.frombuffer(self.buf, dtype=_NUMPY[item], count=count, offset=self.at).tolist()
                self.at += size
                return values
            if item == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            raise ValueError(f"unknown GGUF array item type {item}")
        if kind in _SCALARS:
            return self.scalar(*_SCALARS[kind])
        raise ValueError(f"unknown GGUF value type {kind}")


class GGUFContents:
    """A whole GGUF header read in one pass: every key's value (arrays as lists, the vocabulary included) behind the
    `fields` mapping of a `gguf.GGUFReader`, and the tensor table as `tensors`. It does what the prepare path needs of
    `gguf.GGUFReader` (store.py) several times faster: that reader builds numpy views for each of a 262k-token
    vocabulary's ~786k parts, which made preparing Gemma 3 270M take about 5 s."""

    def __init__(self, path: Path) -> None:
        import mmap

        import gguf

        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    self._parse(_Cursor(view), gguf)
                finally:
                    view.release()
        except (OSError, EOFError, ValueError, struct.error) as exc:
            raise ModelError(f"{path}: not a readable GGUF file ({exc}); re-download or re-export it") from exc

    def _parse(self, cur: _Cursor, gguf: Any) -> None:
        if bytes(cur.buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic at the start")
        cur.at = 4
        version = cur.scalar("<I", 4)
        if not 2 <= version <= 3:
            raise ValueError(f"GGUF version {version} is not one this reader knows (2 or 3)")
        n_tensors, n_kv = cur.scalar("<Q", 8), cur.scalar("<Q", 8)
        # The three header counts come first as pseudo-keys, as gguf.GGUFReader lists them.
        values: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = cur.string()
            values[key] = cur.value(cur.scalar("<I", 4))
        self.fields = {k: _Field(v) for k, v in values.items()}
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.scalar("<Q", 8) for _ in range(cur.scalar("<I", 4)))
            raw.append((name, dims, cur.scalar("<I", 4), cur.scalar("<Q", 8)))
        alignment = int(values.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        start = -(-cur.at // alignment) * alignment
        types = gguf.GGMLQuantizationType
        self.tensors: list[TensorInfo] = []
        for name, dims, kind, offset in raw:
            try:
                tensor_type: Any = types(kind)
                block, size = gguf.GGML_QUANT_SIZES[tensor_type]
                n_bytes = math.prod(dims) // block * size
            except (ValueError, KeyError):
                tensor_type, n_bytes = kind, 0  # an unknown type: read_table refuses it by name
            self.tensors.append(TensorInfo(name, tensor_type, dims, start + offset, n_bytes))
        end = max((t.data_offset + t.n_bytes for t in self.tensors), default=start)
        if end > len(cur.buf):
            raise EOFError(f"the tensor data ends at byte {end}, past the file's end ({len(cur.buf)})")


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
