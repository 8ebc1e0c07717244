"""Large, long-lived host buffers (the CPU KV pool), and the native-memory settings of a long-lived server process.

The KV pool is one anonymous mapping per tensor, committed (on transparent huge pages) on request:
- torch.zeros would write every 4 KiB page at allocation, on the start-up's critical path.
- Left to commit on first use (numpy's calloc, as before), the pool fills in slowly: the block manager hands out
  the least recently freed block first (so prefix-cached content lives longest), which walks the whole pool. The
  server's RSS then climbs for minutes under steady load (2.3x its first-wave size in a 2-minute soak before this
  change; reports/serve/soak.md has the figure now), page faults land on requests, and an over-committed host
  is OOM-killed long after READY instead of at start.
- `commit` asks the kernel to populate the pages (MADV_POPULATE_WRITE) in one foreign call per tensor, which
  releases the GIL. The server runs it on a thread right after READY (lifecycle/service.py), so it costs the
  start-up nothing; huge pages need 512x fewer faults than 4 KiB ones. The offline LLM does not commit: its
  pool commits 4 KiB at a time as blocks are first written (see `anonymous_zeros` for why not huge pages then).

A server's heap also holds what oneDNN caches per matmul shape and what glibc keeps after frees;
`limit_native_caches` and `release_free_heap` bound those (their comments say by how much).
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

# Linux values. MADV_POPULATE_WRITE needs 5.14+; older kernels answer EINVAL and the buffer stays commit-on-first-use.
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc


def anonymous_zeros(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of `nbytes` in its own anonymous mapping, with no page committed yet.

    Pages commit on first write, 4 KiB at a time, until `commit` makes them all resident (on huge pages). Huge
    pages are not asked for before that: a first write into an uncommitted huge page zeroes all 2 MiB of it, so
    an engine that writes its KV pool a block at a time (the offline LLM) would pay a 2 MiB fault for every 6 KiB
    block that lands in a fresh one. The tensor keeps the mapping alive; it is unmapped with the last view."""
    if nbytes <= 0:
        return torch.zeros(0, dtype=torch.uint8)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8)


def commit(tensors: list[torch.Tensor]) -> bool:
    """Make every page of these CPU tensors resident now, on transparent huge pages where the host allows. True
    when the kernel populated them; False when it cannot (not Linux, or a kernel before 5.14), in which case they
    stay commit-on-first-use."""
    if os.name != "posix":
        return False
    try:
        libc = _libc()
    except OSError:
        return False
    page = mmap.PAGESIZE
    for t in tensors:
        if t.device.type != "cpu" or t.nbytes == 0:
            continue
        start = t.data_ptr() // page * page
        length = t.data_ptr() + t.nbytes - start
        libc.madvise(start, length, MADV_HUGEPAGE)  # best effort: THP may be off ("never")
        if libc.madvise(start, length, MADV_POPULATE_WRITE) != 0:
            return False
    return True


# oneDNN (torch's CPU bf16 GEMMs) keeps up to 1024 JIT-compiled primitives, one per matmul shape. A server sees a
# new M for every batch size and prefill length, so its heap grows for minutes after a first wave of traffic. In a
# test of SmolLM2's five linear shapes over M = 1..400 the growth (after malloc_trim) was 524 MiB with the default
# and 281 MiB with 128; the rest also grows per new M (about 0.9 MiB each) and stops once every M has been seen.
# 128 still holds the linears of ~25 batch sizes, so steady decoding does not rebuild primitives.
ONEDNN_PRIMITIVE_CACHE = 128


def limit_native_caches(environ: dict[str, str] | None = None) -> None:
    """For a long-lived server process, before its first GEMM: cap oneDNN's primitive cache (unless the operator
    set ONEDNN_PRIMITIVE_CACHE_CAPACITY). oneDNN reads the variable when it builds its first primitive."""
    env = os.environ if environ is None else environ
    env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE))


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc malloc_trim). Freed tensors of a busy server stay in
    malloc's arenas, fragmented, until trimmed; an idle server should not hold them. False where not glibc."""
    try:
        trim = _libc().malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    trim(0)
    return True
