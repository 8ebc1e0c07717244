"""glowplug's native CPU kernels (kernels/native/*.cpp): build per ISA level, choose one at run time, load, and convert
weights for them.

The kernels are written against torch's stable C ABI only, so building them needs a C++ compiler and torch's
headers, and never pulls in the heavy ATen headers. One variant is built per ISA level (base.machine.ISA_LEVELS:
portable, avx2, avx512, avx512_bf16, amx), each with its level's flags only (`LEVEL_FLAGS`), and a start loads the
variant of the level `base.machine.isa_choice` picks: the CPU's highest, or lower under GLOWPLUG_MAX_CPU_ISA.
`glowplug kernels build` (scripts/setup.sh runs it) builds every level at install time, so a start never runs the
compiler; without that, the first start builds its level into the cache (artifact store `native`), keyed by what
changes the binary: the sources, torch, the level and the architecture. A damaged library is rebuilt. How each op
runs at each level: the comments of the .cpp files (hand-written AVX512/AMX code where the level has it, portable
C++ that the compiler vectorizes for the level's flags elsewhere).

Ops (namespace `glowplug_native`; x [M, K] contiguous, y [M, N] in x's dtype):
  dense_blocked(x, wp, N)                 bf16 x and weights in the blocked layout of `pack_blocked`
  intn_blocked(x, wp, N, bits, gs)        bf16 x, int4/int2 weights (w = q * scale + min per group), blocked;
                                          int4 from AVX2 up (below AMX batches): x taken to int8 per group,
                                          integer dot products (oracle: reference.quantize_x8)
  int8_blocked(x, wp, N, gs)              bf16 x taken to 16-bit fixed point per 32 inputs, int8 weights (per
                                          channel: gs = K), blocked, VNNI
  dense_linear(x, w, small_m)             fp32 (or bf16 without AVX512-BF16) x and row-major weights; M > small_m
                                          goes to aten's GEMM
  w8a8_linear(x, q, wscale, wsum, inv)    per-token int8 activations, VNNI dot products
  decode_attention(q, k_cache, v_cache, packed, scale, window=0)
  decode_attention_int8(q, k_cache, v_cache, k_scale, v_scale, packed, scale, window=0)
                                          one decode token per sequence over the paged cache (attention.cpp);
                                          window > 0: each row's last `window` positions only, the blocks
                                          before them not read
  argmax_rows(x)                          fp32 or bf16 x [rows, n] -> int64 [rows]: each row's first maximum, as
                                          torch's max(dim=-1).indices (rows.cpp; the sampler's greedy tokens)
At the amx level the blocked ones run batches of several rows on AMX tiles (amx.h; the library asks Linux for the
tile state at first use). Each linear op has a pure-torch
reference in kernels/reference.py (`native_linear`), which tests/kernels compare against; the attention ops' references
are `reference.paged_decode_attention_reference` and the torch path of engine/attention.decode_attention.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

# The CPU flags are machine facts (base), read before torch is imported too (the dtype check of the CLI).
from glowplug.base.machine import ISA_LEVELS, isa_choice, on_x86

from .formats import Int2Weight, Int4Weight, Int8Weight, PackedWeight, W8A8Weight

NAMESPACE = "glowplug_native"
LIBRARY = "glowplug_native.so"
SOURCES: tuple[str, ...] = ("linear.cpp", "blocked.cpp", "attention.cpp", "rows.cpp", "gguf.cpp")
HEADERS: tuple[str, ...] = ("common.h", "dequant.h", "amx.h")
_SOURCE_DIR = Path(__file__).parent / "native"


@dataclass(frozen=True)
class NativeBuild:
    """Outcome of making the native library available in this process."""

    available: bool
    path: Path | None
    cache_hit: bool  # no compiler ran on the way (a prebuilt or cached variant)
    seconds: float
    reason: str  # why not available, or what happened ("prebuilt", "cached", "built: ...")
    level: str = ""  # the ISA level of the variant loaded ("" when none)
    level_reason: str = ""  # why that level (the CPU's, a cap, or the best variant there was)
    background: str = ""  # a variant being built in the background for the next start, and why


# Compiler flags per ISA level (base.machine.ISA_LEVELS): each variant gets its level's flags and nothing above, so
# it runs on every CPU of that level, whatever machine built it. -mtune stays generic: the binary may be prebuilt.
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni")
LEVEL_FLAGS: dict[str, tuple[str, ...]] = {
    "portable": (),
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": (*_AVX512, "-mavx512bf16"),
    "amx": (*_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}
PREBUILT_ENV = "GLOWPLUG_NATIVE_PREBUILT"
BUILD_INFO = "build.json"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _torch_dirs() -> tuple[Path, Path]:
    root = Path(torch.__file__).parent
    return root / "include", root / "lib"


def buildable_levels() -> tuple[str, ...]:
    """The levels a compiler on this architecture can target (all of them on x86, the portable one elsewhere)."""
    return ISA_LEVELS if on_x86() else ("portable",)


def prebuilt_root() -> Path:
    """Where `glowplug kernels build` puts the variants at install time (an artifact store of its own, beside the
    sources), unless GLOWPLUG_NATIVE_PREBUILT names another folder. Not a cache: an empty cache dir keeps it."""
    override = os.environ.get(PREBUILT_ENV, "").strip()
    return Path(override) if override else _SOURCE_DIR / "prebuilt"


def build_factors(level: str) -> dict[str, str]:
    """Every input that changes a variant's binary in a way that matters: the sources, the torch it links, the
    level and the architecture. The compiler is not one: any working compiler's build is the same kernels, so a
    variant prebuilt with another compiler serves (the compiler that built it is in the entry's build.json)."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update((_SOURCE_DIR / name).read_bytes())
    return {
        "sources": h.hexdigest()[:16],
        "torch": torch.__version__,
        "level": level,
        "machine": platform.machine().lower(),
    }


def compile_command(compiler: str, out: Path, level: str) -> list[str]:
    include, lib = _torch_dirs()
    return [
        compiler,
        "-O3",
        *LEVEL_FLAGS[level],
        "-shared",
        "-fPIC",
        "-std=c++17",
        "-I",
        str(include),
        *[str(_SOURCE_DIR / s) for s in SOURCES],
        "-o",
        str(out),
        "-L",
        str(lib),
        "-ltorch_cpu",
        "-lc10",
        "-ltorch",
        f"-Wl,-rpath,{lib}",
    ]


def _compile(compiler: str, out: Path, level: str) -> None:
    cmd = compile_command(compiler, out, level)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-20:])
        raise RuntimeError(f"building the {level} native kernels failed ({' '.join(cmd[:3])} ...):\n{tail}")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    info = {
        "compiler": version.splitlines()[0] if version else compiler,
        "flags": list(LEVEL_FLAGS[level]),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    (out.parent / BUILD_INFO).write_text(json.dumps(info))


def build_variant(store_root: Path, level: str, *, compiler: str | None = None) -> tuple[Path, bool]:
    """Build `level`'s variant into the artifact store at `store_root` unless a sound one is there; returns the
    library's path and whether it was built now. Raises RuntimeError without a compiler or on a failed build."""
    from glowplug.base.artifacts import ArtifactStore
    from glowplug.base.artifacts.caches import NATIVE

    cxx = compiler or _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, or $CXX) on PATH")

    def build(folder: Path | None) -> Path:
        target = (folder or Path(tempfile.mkdtemp(prefix="glowplug-native-"))) / LIBRARY
        _compile(cxx, target, level)
        return target

    fetched = ArtifactStore(store_root).fetch(
        NATIVE, build_factors(level), group=f"native-{level}", build=build, load=_library_file
    )
    path = fetched.value if fetched.hit or fetched.path is None else fetched.path / LIBRARY
    return path, not fetched.hit


def _library_file(folder: Path) -> Path:
    """An entry's library, checked to exist (the store verifies its checksums); not loaded, so that a process can
    look at several variants and load one."""
    lib = folder / LIBRARY
    if not lib.is_file():
        raise OSError(f"{lib} is missing")
    return lib


def find_variant(level: str, cache_dir: Path, *, load: bool = False) -> tuple[Path, str] | None:
    """A stored variant of `level`: prebuilt first, then the cache; (library, where) or None. `load`: load it into
    this process too, so that a library that will not load counts as a damaged entry (moved aside, a miss)."""
    from glowplug.base.artifacts import ArtifactStore
    from glowplug.base.artifacts.caches import NATIVE

    def open_entry(folder: Path) -> Path:
        lib = _library_file(folder)
        if load:
            torch.ops.load_library(str(lib))  # OSError for a damaged file: the store moves the entry aside
        return lib

    for root, where in ((prebuilt_root(), "prebuilt"), (cache_dir, "cached")):
        found = ArtifactStore(root).lookup(NATIVE, build_factors(level), group=f"native-{level}", load=open_entry)
        if found.value is not None:
            return found.value, where
    return None


def variant_entries(cache_dir: Path) -> list[Path]:
    """The stored variants (entry folders) of every level this CPU can run, prebuilt or cached, one per level: what
    a bundle carries, so that a machine with no compiler and no prebuilt set still loads the kernels, and one
    started under a lower GLOWPLUG_MAX_CPU_ISA finds that level's variant too."""
    from glowplug.base.artifacts import ArtifactStore
    from glowplug.base.artifacts.caches import NATIVE

    levels = buildable_levels()
    cpu_level = isa_choice().cpu_level
    out: list[Path] = []
    for level in levels[: levels.index(cpu_level) + 1] if cpu_level in levels else levels[:1]:
        for root in (prebuilt_root(), cache_dir):
            store = ArtifactStore(root)
            factors = build_factors(level)
            if store.probe(NATIVE, factors):
                out.append(store.entry_path(NATIVE, store.key(NATIVE, factors)))
                break
    return out


def stored_variant(cache_dir: Path) -> str | None:
    """Where the variant `load_native` would load comes from, asked without loading or verifying it (the start-up
    ETA's probe): "disabled", "loaded" (already in this process), "prebuilt" or "cached", or None when a start
    would have to build one. Same search order as `load_native`: the chosen level, then the levels below it."""
    from glowplug.base.artifacts import ArtifactStore
    from glowplug.base.artifacts.caches import NATIVE

    if os.environ.get("GLOWPLUG_NATIVE", "1") == "0":
        return "disabled"
    if _loaded():
        return "loaded"
    level = isa_choice().level
    for candidate in ISA_LEVELS[: ISA_LEVELS.index(level) + 1][::-1]:
        factors = build_factors(candidate)
        for root, where in ((prebuilt_root(), "prebuilt"), (cache_dir, "cached")):
            if ArtifactStore(root).probe(NATIVE, factors):
                return where
    return None


def compiler_available() -> bool:
    return _compiler() is not None


def _build_in_background(level: str, cache_dir: Path) -> str:
    """Start `python -m glowplug.kernels.native_build LEVEL CACHE` detached, so the next start finds the variant;
    a start never waits for it. Returns what was started, or why not."""
    if _compiler() is None:
        return f"{level} not built: no C++ compiler (g++, or $CXX) on PATH"
    if os.environ.get("GLOWPLUG_NATIVE_BACKGROUND_BUILD", "1") == "0":
        return f"{level} not built: GLOWPLUG_NATIVE_BACKGROUND_BUILD=0"
    from glowplug.base.artifacts import ArtifactStore
    from glowplug.base.artifacts.caches import NATIVE

    store = ArtifactStore(cache_dir)
    problem = store.write_problem(NATIVE)
    if problem is not None:  # a build could not store its variant (a read-only cache dir): a miss, said once
        store.bypass(NATIVE, problem)
        return f"{level} not built: GLOWPLUG_CACHE_DIR {problem.problem}"
    cmd = [sys.executable, "-m", "glowplug.kernels.native_build", level, str(cache_dir)]
    subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    return f"building {level} in the background for the next start"


def _loaded() -> bool:
    try:
        getattr(torch.ops, NAMESPACE).dense_linear  # noqa: B018 - the lookup is the check
    except (AttributeError, RuntimeError):
        return False
    return True


@functools.cache
def _register_fakes() -> None:
    """Shape functions for tracing (torch.compile sees the ops as opaque calls with these output shapes)."""
    lib = f"{NAMESPACE}::"

    @torch.library.register_fake(lib + "dense_linear")
    def _dense(x: Tensor, w: Tensor, small_m: int) -> Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake(lib + "w8a8_linear")
    def _w8a8(x: Tensor, q: Tensor, wscale: Tensor, wsum: Tensor, inv_smooth: Tensor) -> Tensor:
        return x.new_empty((x.shape[0], q.shape[0]))

    @torch.library.register_fake(lib + "dense_blocked")
    def _dense_blocked(x: Tensor, wp: Tensor, n: int) -> Tensor:
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake(lib + "intn_blocked")
    def _intn_blocked(x: Tensor, wp: Tensor, n: int, bits: int, group_size: int) -> Tensor:
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake(lib + "int8_blocked")
    def _int8_blocked(x: Tensor, wp: Tensor, n: int, group_size: int) -> Tensor:
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake(lib + "decode_attention")
    def _attention(q: Tensor, k: Tensor, v: Tensor, packed: Tensor, scale: float, window: int = 0) -> Tensor:
        return q.new_empty(q.shape)

    @torch.library.register_fake(lib + "decode_attention_int8")
    def _attention_int8(
        q: Tensor, k: Tensor, v: Tensor, ks: Tensor, vs: Tensor, packed: Tensor, scale: float, window: int = 0
    ) -> Tensor:
        return q.new_empty(q.shape)

    @torch.library.register_fake(lib + "argmax_rows")
    def _argmax_rows(x: Tensor) -> Tensor:
        return x.new_empty((x.shape[0],), dtype=torch.long)

    @torch.library.register_fake(lib + "gguf_linear")
    def _gguf_linear(
        x: Tensor, w0: Tensor, t0: int, p0: Tensor, w1: Tensor, t1: int, p1: Tensor, w2: Tensor, t2: int, p2: Tensor
    ) -> Tensor:
        return x.new_empty((x.shape[0], w0.shape[0] + w1.shape[0] + w2.shape[0]))

    @torch.library.register_fake(lib + "gguf_rows")
    def _gguf_rows(w: Tensor, type: int, k: int, ids: Tensor, bf16: int) -> Tensor:
        return w.new_empty((ids.shape[0], k), dtype=torch.bfloat16 if bf16 else torch.float32)


_LOADED: dict[str, str] = {}  # the level of the variant this process loaded (one per process: same op names)


def load_native(cache_dir: Path) -> NativeBuild:
    """Make the native ops callable in this process at the ISA level `base.machine.isa_choice` picks.

    Where the variant comes from, first found wins: prebuilt at install (`glowplug kernels build`) or already in
    the cache (artifact store `native`), with no compiler run; else, when a lower level's variant is stored, that
    one now and the right level built in the background for the next start (a start never waits for g++ while some
    variant can run); else the level built now into the cache. A library that will not load is a damaged entry,
    moved aside and rebuilt.

    Never raises for an environment problem (no compiler, a failed build): the answer says why the kernels are
    unavailable, and callers fall back to the stock torch paths. A GLOWPLUG_MAX_CPU_ISA that names no level
    raises IsaCapError (a setting, checked before the start by engine.config_check)."""
    t0 = time.perf_counter()
    choice = isa_choice()
    if _loaded():
        level = _LOADED.get("level", choice.level)
        return NativeBuild(
            True,
            None,
            True,
            time.perf_counter() - t0,
            "already loaded in this process",
            level,
            choice.reason if level == choice.level else f"{level}: loaded earlier in this process",
        )
    if os.environ.get("GLOWPLUG_NATIVE", "1") == "0":
        return NativeBuild(False, None, False, 0.0, "disabled by GLOWPLUG_NATIVE=0")
    level = choice.level
    try:
        found = find_variant(level, cache_dir, load=True)
        if found is not None:
            return _loaded_build(found[0], level, found[1], True, choice.reason, t0)
        lower = ISA_LEVELS[: ISA_LEVELS.index(level)][::-1]
        for below in lower:
            found = find_variant(below, cache_dir, load=True)
            if found is not None:
                started = _build_in_background(level, cache_dir)
                why = f"{below}: the best variant stored ({level} is not built yet)"
                return _loaded_build(found[0], below, found[1], True, why, t0, started)
        if _compiler() is None:
            return NativeBuild(
                False,
                None,
                False,
                time.perf_counter() - t0,
                "no C++ compiler (g++, or $CXX) on PATH, and no prebuilt variant (`glowplug kernels "
                "build` at install time makes them)",
            )
        path, built = build_variant(cache_dir, level)
        torch.ops.load_library(str(path))
        return _loaded_build(path, level, "built" if built else "cached", not built, choice.reason, t0)
    except (OSError, RuntimeError) as exc:
        return NativeBuild(False, None, False, time.perf_counter() - t0, str(exc).splitlines()[0])


def _loaded_build(
    path: Path, level: str, where: str, hit: bool, why: str, t0: float, background: str = ""
) -> NativeBuild:
    """The answer for a variant just loaded into this process."""
    _LOADED["level"] = level
    _register_fakes()
    if where == "built":
        where = "built (no prebuilt variant: `glowplug kernels build` at install keeps the compiler off the start)"
    return NativeBuild(True, path, hit, time.perf_counter() - t0, where, level, why, background)


def loaded_level() -> str | None:
    """The ISA level of the native library this process loaded, or None."""
    return _LOADED.get("level") if _loaded() else None


def ops() -> object:
    """The loaded op namespace (`torch.ops.glowplug_native`); call `load_native` first."""
    return getattr(torch.ops, NAMESPACE)


def first_max_indices(x: Tensor) -> Tensor:
    """Each row's index of its first maximum, as `x.max(dim=-1).indices` gives it: with the native op where the
    library is loaded and x is a float32 or bfloat16 [rows, n] CPU tensor (torch's reduction tracks the index in a
    scalar loop; the op is one vector pass per row, rows split across the threads), else torch's."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.shape[1] > 0:
        try:
            op = getattr(torch.ops, NAMESPACE).argmax_rows
        except (AttributeError, RuntimeError):  # not loaded in this process (or an older build without the op)
            return x.max(dim=-1).indices
        result: Tensor = op(x.contiguous())
        return result
    return x.max(dim=-1).indices


# ------------------------------------------------------------------------------------------- weight layouts
BLOCK = 16  # rows per N-block of the blocked layouts


def _blocks(t: Tensor) -> Tensor:
    """[N, ...] -> [NB, 16, ...], padding N with zero rows."""
    n = t.shape[0]
    pad = -n % BLOCK
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape(-1, BLOCK, *t.shape[1:])


def _plane_words(codes: Tensor, bits: int) -> Tensor:
    """codes [N, K] (unsigned, < 2**bits) -> uint8 [NB, K * bits * 2] chunk words (blocked.cpp's layout): plane p of
    word 2j + e of a chunk is row j's code at k0 + 2p + e."""
    planes = 16 // bits
    kc = 2 * planes
    b = _blocks(codes.to(torch.int32))  # [NB, 16, K]
    nb, _, k = b.shape
    t = b.reshape(nb, BLOCK, k // kc, planes, 2)  # [..., p, e]: k = k0 + 2p + e
    words = torch.zeros(nb, BLOCK, k // kc, 2, dtype=torch.int32)
    for p in range(planes):
        words |= t[:, :, :, p, :] << (bits * p)
    words = words.permute(0, 2, 1, 3).contiguous()  # [NB, chunk, 16 rows, e] = word 2j + e of each chunk
    return words.to(torch.int16).view(torch.uint8).reshape(nb, -1)


def _per_block(values: Tensor, dtype: torch.dtype) -> Tensor:
    """[N, G] -> bytes [NB, G * 16 * itemsize] laid out [G][16]."""
    b = _blocks(values.to(dtype))  # [NB, 16, G]
    return b.permute(0, 2, 1).contiguous().view(torch.uint8).reshape(b.shape[0], -1)


def pack_blocked(w: PackedWeight | Tensor) -> tuple[Tensor, int]:
    """The blocked layout of blocked.cpp for a dense bf16 matrix [N, K] or a packed int8/int4/int2 weight, and the
    group size the kernel reads it with (K for per-channel int8, 0 for dense)."""
    if isinstance(w, Tensor):
        b = _blocks(w.to(torch.bfloat16))  # [NB, 16, K]
        nb, _, k = b.shape
        return b.view(torch.int16).reshape(nb, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous(), 0
    n, k = w.shape
    if isinstance(w, (Int4Weight, Int2Weight)):
        bits = 4 if isinstance(w, Int4Weight) else 2
        mid = 1 << (bits - 1)
        scales = w.scales.float()
        zeros = torch.zeros_like(scales) if w.zeros is None else w.zeros.float()
        # w = q * scale + min, min = zero - mid * scale; fp16 keeps a GGUF source's fp16 block scales exact.
        parts = [
            _plane_words(w.codes(), bits),
            _per_block(scales, torch.float16),
            _per_block(zeros - mid * scales, torch.float16),
        ]
        return torch.cat(parts, dim=1).contiguous(), w.group_size
    if isinstance(w, Int8Weight):
        # A chunk holds 4 codes of each row: dword j = row j's codes at k0..k0 + 3 as unsigned bytes q + 128.
        b = _blocks((w.qweight.to(torch.int32) + 128).to(torch.uint8))  # padding rows: code 0, scale 0
        nb, _, kk = b.shape
        codes = b.reshape(nb, BLOCK, kk // 4, 4).permute(0, 2, 1, 3).contiguous().reshape(nb, -1)
        gs = k if w.group_size is None else w.group_size
        scales = w.scales.float().reshape(n, -1)
        return torch.cat([codes, _per_block(scales, torch.float32)], dim=1).contiguous(), gs
    raise TypeError(f"no blocked layout for {type(w).__name__}")


@dataclass(frozen=True)
class NativeState:
    """The tensors and constants one native op call needs for one layer (derived at load time)."""

    kind: str  # "int8" | "intn" | "w8a8"
    tensors: tuple[Tensor, ...]
    n: int
    k: int
    bits: int = 0
    group_size: int = 0
    nbytes: int = 0  # what a decode step reads through it


def attention_supported(head_dim: int) -> bool:
    """The decode attention op takes a head_dim that is a multiple of 16 (at every level)."""
    return head_dim % 16 == 0


def prepare_native(w: PackedWeight, activation_dtype: torch.dtype) -> NativeState | None:
    """The native state for a packed weight with activations of `activation_dtype`, or None when no native
    kernel serves that combination (the layer then keeps the dispatcher's kernels)."""
    n, k = w.shape
    if isinstance(w, W8A8Weight):
        inv = torch.empty(0)
        if w.smooth is not None and not bool(torch.all(w.smooth == 1)):
            inv = (1.0 / w.smooth.float()).contiguous()
        wsum = w.qweight.to(torch.int32).sum(dim=1).to(torch.int32).contiguous()
        tensors = (w.qweight.contiguous(), w.scales.float().reshape(-1).contiguous(), wsum, inv)
        return NativeState("w8a8", tensors, n, k, nbytes=sum(t.numel() * t.element_size() for t in tensors))
    # fp32 activations are rounded to bf16 for these kernels, as the eager dispatcher's packed kernels do too.
    if activation_dtype not in (torch.bfloat16, torch.float32) or k % 32:
        return None
    if isinstance(w, Int8Weight) and w.group_size is not None and w.group_size % 32:
        return None  # the int8 kernel scales activations per 32 inputs, inside each weight group
    packed, gs = pack_blocked(w)
    bits = 4 if isinstance(w, Int4Weight) else 2 if isinstance(w, Int2Weight) else 8
    kind = "int8" if bits == 8 else "intn"
    return NativeState(kind, (packed,), n, k, bits, gs, nbytes=packed.numel() * packed.element_size())


def native_linear(x: Tensor, st: NativeState, tensors: tuple[Tensor, ...] | None = None) -> Tensor:
    """y = x @ W^T through the native op for `st` (x [M, K]). `tensors` overrides st.tensors (a module passes its
    registered buffers, so a traced graph takes them as inputs)."""
    t = st.tensors if tensors is None else tensors
    o = ops()
    if st.kind == "w8a8":
        return o.w8a8_linear(x, t[0], t[1], t[2], t[3])  # type: ignore[attr-defined,no-any-return]
    xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
    if st.kind == "int8":
        y = o.int8_blocked(xb, t[0], st.n, st.group_size)  # type: ignore[attr-defined]
    else:
        y = o.intn_blocked(xb, t[0], st.n, st.bits, st.group_size)  # type: ignore[attr-defined]
    return y if y.dtype == x.dtype else y.to(x.dtype)  # type: ignore[no-any-return]


def native_weight_bytes(st: NativeState) -> int:
    """Bytes one decode step reads through this layer's native kernel."""
    return st.nbytes
