"""How much of a file is in the OS page cache right now, from mincore(2) on a read-only shared mapping.

A start that reads or maps a model file pays disk time only for the pages that are not resident; the rest comes at
memory speed. The start-up model (engine/start_model.py) takes the resident share as one of its inputs, so a warm
restart right after a cold one is not predicted to read the file from disk again, and a start after the page cache
was dropped is not predicted to read it from memory.

Mapping a file and asking mincore reads none of its pages (the kernel only answers from the page tables of the
cache), so this costs microseconds per GB. Linux and other systems with mincore(2) only; elsewhere (or for a file
that cannot be mapped) the answer is None: unknown, never a guess.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_PROT_READ = mmap.PROT_READ
_MAP_SHARED = mmap.MAP_SHARED
_MAP_FAILED = ctypes.c_void_p(-1).value
# Pages asked of mincore per call: bounds the vector (1 byte per page) whatever the file's size.
_CHUNK_PAGES = 1 << 18
_LOW_BIT = bytes(b & 1 for b in range(256))


@dataclass(frozen=True)
class Residency:
    """Bytes of a set of files, and how many of them the page cache holds."""

    total: int
    resident: int

    @property
    def share(self) -> float:
        """Resident bytes over all bytes (1.0 for nothing to read)."""
        return self.resident / self.total if self.total > 0 else 1.0

    @property
    def cold(self) -> int:
        """Bytes a read would take from the disk."""
        return max(0, self.total - self.resident)

    def __add__(self, other: Residency) -> Residency:
        return Residency(self.total + other.total, self.resident + other.resident)


def _load(name: str | None) -> ctypes.CDLL | None:
    """The library `name` (None: the process's own symbols) when it has mincore."""
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    return lib if hasattr(lib, "mincore") else None


def _libc() -> ctypes.CDLL | None:
    """The C library's mmap, munmap and mincore. The process's own symbols first (dlopen(NULL): libc is linked
    into every CPython on the systems with mincore), since find_library runs `ldconfig -p`, tens of milliseconds
    at every import."""
    lib = _load(None)
    if lib is None:
        from ctypes.util import find_library

        lib = _load(find_library("c"))
    if lib is None:
        return None
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.munmap.restype = ctypes.c_int
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.mincore.restype = ctypes.c_int
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return lib


_LIBC = _libc()


def file_residency(path: Path | str) -> Residency | None:
    """The file's size and its bytes in the page cache; None when the system cannot tell (no mincore, a file that
    cannot be opened or mapped). An empty file is wholly resident."""
    if _LIBC is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return Residency(0, 0)
        addr = _LIBC.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            return None
        try:
            return Residency(size, _resident(addr, size))
        finally:
            _LIBC.munmap(addr, size)
    finally:
        os.close(fd)


def _resident(addr: int, size: int) -> int:
    page = mmap.PAGESIZE
    pages = -(-size // page)
    resident_pages = 0
    vec = (ctypes.c_ubyte * min(pages, _CHUNK_PAGES))()
    for first in range(0, pages, _CHUNK_PAGES):
        count = min(_CHUNK_PAGES, pages - first)
        if _LIBC.mincore(addr + first * page, count * page, vec) != 0:  # type: ignore[union-attr]
            raise OSError(ctypes.get_errno(), "mincore failed")
        # The low bit of each byte says whether that page is resident (the others are reserved).
        resident_pages += count - bytes(vec)[:count].translate(_LOW_BIT).count(0)
    # The last page may be partly past the file's end: never count more than the file.
    return min(size, resident_pages * page)


def memory_resident_bytes(addr: int, size: int) -> int | None:
    """How many bytes of this process's memory [addr, addr + size) are resident (mincore on the pages it spans);
    None where that cannot be told. A pool allocated but never written holds no pages yet."""
    if _LIBC is None or size <= 0:
        return None if _LIBC is None else 0
    page = mmap.PAGESIZE
    start = addr - addr % page
    try:
        return min(size, _resident(start, addr + size - start))
    except OSError:
        return None


def files_residency(paths: Iterable[Path | str]) -> Residency | None:
    """The sum over `paths`; None when any of them cannot be told (a partial answer would pass for a whole one)."""
    total = Residency(0, 0)
    for path in paths:
        one = file_residency(path)
        if one is None:
            return None
        total = total + one
    return total
