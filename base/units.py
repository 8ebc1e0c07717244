"""Byte sizes as people write them (`2GiB`, `512MiB`, `1G`), for every schema field that asks for a size.

One parser behind a pydantic type, so a flag, a config file and an HTTP field all accept the same spellings and
reject the same mistakes with the same message. The rules, chosen to match what memory flags elsewhere mean:
  a plain integer          bytes (`1073741824`)
  KiB MiB GiB TiB          powers of 1024
  K M G T (one letter)     powers of 1024 too, as in `docker -m 1g` and `java -Xmx1g`: a memory size, not a disk's
  KB MB GB TB              powers of 1000, for whoever means exactly that
  B                        bytes
Units are case-insensitive, a space between number and unit is fine, and a fraction is allowed (`1.5GiB`); the
result is rounded down to whole bytes.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
SIZE_EXAMPLES = "2GiB, 512MiB, 1G (= 1 GiB), 1GB (= 10^9 bytes) or a plain number of bytes"


def parse_byte_size(value: Any) -> Any:
    """`2GiB` -> 2147483648; an int passes through (bytes); anything else unparseable raises ValueError."""
    if value is None or isinstance(value, bool):
        return value  # None is "unset"; a bool is left for the int validator to refuse
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{value!r} is not a whole number of bytes; write a size such as {SIZE_EXAMPLES}")
        return int(value)
    if not isinstance(value, str):
        return value
    m = _SIZE.fullmatch(value)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"{value!r} is not a size; write one such as {SIZE_EXAMPLES}")
    number = float(m.group(1)) if "." in m.group(1) else int(m.group(1))
    return int(number * _UNITS[unit])


def format_bytes(n: int) -> str:
    """A size the way the parser reads it back: `1.5 GiB`, `512 MiB`, `900 B` (binary units)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            if unit == "B":
                return f"{int(size)} B"
            return f"{size:.1f} {unit}".replace(".0 ", " ")
        size /= 1024
    return f"{n} B"


def size_flag_value(n: int) -> str:
    """A size as a flag value that the parser reads back as at least `n` bytes, rounded up to a whole MiB (or
    GiB past 16 GiB): what an error message suggests passing."""
    mib = -(-n // (1 << 20))
    if mib > 16 * 1024:
        return f"{-(-n // (1 << 30))}GiB"
    return f"{mib}MiB"


# The schema type: validated from any of the spellings above, stored and dumped as an int of bytes.
ByteSize = Annotated[int, BeforeValidator(parse_byte_size), PlainSerializer(int, return_type=int)]
