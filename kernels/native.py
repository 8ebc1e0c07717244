"""glowplug's native CPU kernels (kernels/native/*.cpp): build once per machine, load, and convert weights for them.

The kernels are written against torch's stable C ABI only, so building them needs the machine's C++ compiler and
torch's headers, takes about a second, and never pulls in the heavy ATen headers. They are built at first use with
`-march=native` (the binary is for this CPU) into the glowplug cache, keyed by everything that changes the binary:
the sources, the torch version, the compiler and the CPU's feature flags. A damaged cached library is rebuilt.

Ops (namespace `glowplug_native`, shapes: x [M, K] bf16|fp32 contiguous, y [M, N] in x's dtype):
  dense_linear(x, w, small_m)                   w [N, K] in x's dtype; M > small_m goes to aten's GEMM
  int8_linear(x, q, scales)                     q int8 [N, K], scales fp32 [N, G]
  intn_linear(x, rows, N, K, bits, group_size)  fused int4/int2 rows from `pack_intn_rows`
  w8a8_linear(x, q, wscale, wsum, inv_smooth)   per-token int8 activations, VNNI dot products
Each has a pure-torch reference in kernels/reference.py (`native_reference`), which the tests compare against.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .formats import Int2Weight, Int4Weight, Int8Weight, PackedWeight, W8A8Weight

NAMESPACE = "glowplug_native"
LIBRARY = "glowplug_native.so"
SOURCES: tuple[str, ...] = ("linear.cpp",)
_SOURCE_DIR = Path(__file__).parent / "native"


@dataclass(frozen=True)
class NativeBuild:
    """Outcome of making the native library available in this process."""

    available: bool
    path: Path | None
    cache_hit: bool
    seconds: float
    reason: str  # why not available, or what happened ("built", "cached", "rebuilt: ...")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """bf16 arithmetic in hardware (AVX512-BF16 or AMX): what makes bf16 the fast dtype on a CPU."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _torch_dirs() -> tuple[Path, Path]:
    root = Path(torch.__file__).parent
    return root / "include", root / "lib"


def build_factors(compiler: str) -> dict[str, str]:
    """Every input that changes the binary, and nothing else (any change rebuilds)."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((_SOURCE_DIR / name).read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    return {
        "sources": h.hexdigest()[:16],
        "torch": torch.__version__,
        "compiler": version.splitlines()[0] if version else compiler,
        "cpu_flags": hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16],
    }


def _compile(compiler: str, out: Path) -> None:
    include, lib = _torch_dirs()
    cmd = [compiler, "-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-I", str(include),
           *[str(_SOURCE_DIR / s) for s in SOURCES], "-o", str(out), "-L", str(lib), "-ltorch_cpu", "-lc10",
           "-ltorch", f"-Wl,-rpath,{lib}"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-20:])
        raise RuntimeError(f"building the native kernels failed ({' '.join(cmd[:3])} ...):\n{tail}")


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

    @torch.library.register_fake(lib + "int8_linear")
    def _int8(x: Tensor, q: Tensor, scales: Tensor) -> Tensor:
        return x.new_empty((x.shape[0], q.shape[0]))

    @torch.library.register_fake(lib + "intn_linear")
    def _intn(x: Tensor, rows: Tensor, n: int, k: int, bits: int, group_size: int) -> Tensor:
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake(lib + "w8a8_linear")
    def _w8a8(x: Tensor, q: Tensor, wscale: Tensor, wsum: Tensor, inv_smooth: Tensor) -> Tensor:
        return x.new_empty((x.shape[0], q.shape[0]))


def load_native(cache_dir: Path) -> NativeBuild:
    """Make the native ops callable in this process, building them into the artifact store (cache `native`) when
    needed: a library that will not load is a damaged entry, moved aside and rebuilt.

    Never raises for an environment problem (no compiler, a failed build): the answer says why the kernels are
    unavailable, and callers fall back to the stock torch paths."""
    t0 = time.perf_counter()
    if _loaded():
        return NativeBuild(True, None, True, time.perf_counter() - t0, "already loaded in this process")
    if os.environ.get("GLOWPLUG_NATIVE", "1") == "0":
        return NativeBuild(False, None, False, 0.0, "disabled by GLOWPLUG_NATIVE=0")
    compiler = _compiler()
    if compiler is None:
        return NativeBuild(False, None, False, 0.0, "no C++ compiler (g++, or $CXX) on PATH")
    from glowplug.engine.artifacts import ArtifactStore
    from glowplug.engine.artifacts.caches import NATIVE

    def build(folder: Path | None) -> Path:
        # Without a usable cache dir the library still has to live in a file to be loaded: a temporary folder.
        target = (folder or Path(tempfile.mkdtemp(prefix="glowplug-native-"))) / LIBRARY
        _compile(compiler, target)
        return target

    def load(folder: Path) -> Path:
        torch.ops.load_library(str(folder / LIBRARY))  # OSError for a damaged file: the store rebuilds it
        return folder / LIBRARY

    try:
        fetched = ArtifactStore(cache_dir).fetch(NATIVE, build_factors(compiler), group="native", build=build,
                                                 load=load)  # fmt: skip
        # A build returns its temporary path; the stored entry is where it was renamed to (None: not stored).
        path = fetched.value if fetched.hit or fetched.path is None else fetched.path / LIBRARY
        if not fetched.hit:
            torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        return NativeBuild(False, None, False, time.perf_counter() - t0, str(exc).splitlines()[0])
    _register_fakes()
    reason = "cached" if fetched.hit else f"built ({fetched.miss_reason or 'new'})"
    return NativeBuild(True, path, fetched.hit, time.perf_counter() - t0, reason)


def ops() -> object:
    """The loaded op namespace (`torch.ops.glowplug_native`); call `load_native` first."""
    return getattr(torch.ops, NAMESPACE)


# ------------------------------------------------------------------------------------------- weight layouts
def pack_intn_rows(w: Int4Weight | Int2Weight) -> Tensor:
    """Fused rows for intn_linear: each row's planar codes, then G fp16 scales and G fp16 mins, where
    w = q * scale + min (min = zero - mid * scale), plus zero rows at the end so vector loads may run past the last
    row. fp16 keeps a GGUF source's fp16 block scales exact."""
    mid = 8 if isinstance(w, Int4Weight) else 2
    scales = w.scales.float()
    zeros = torch.zeros_like(scales) if w.zeros is None else w.zeros.float()
    s16 = scales.to(torch.float16)
    m16 = (zeros - mid * scales).to(torch.float16)
    rows = torch.cat([w.qweight, s16.view(torch.uint8), m16.view(torch.uint8)], dim=1)
    pad = -(-64 // rows.shape[1])
    return torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]).contiguous()


@dataclass(frozen=True)
class NativeState:
    """The tensors and constants one native op call needs for one layer (derived at load time)."""

    kind: str  # "int8" | "intn" | "w8a8"
    tensors: tuple[Tensor, ...]
    n: int
    k: int
    bits: int = 0
    group_size: int = 0


def prepare_native(w: PackedWeight) -> NativeState:
    n, k = w.shape
    if isinstance(w, Int8Weight):
        return NativeState("int8", (w.qweight.contiguous(), w.scales.float().contiguous()), n, k)
    if isinstance(w, (Int4Weight, Int2Weight)):
        bits = 4 if isinstance(w, Int4Weight) else 2
        return NativeState("intn", (pack_intn_rows(w),), n, k, bits, w.group_size)
    if isinstance(w, W8A8Weight):
        inv = torch.empty(0)
        if w.smooth is not None and not bool(torch.all(w.smooth == 1)):
            inv = (1.0 / w.smooth.float()).contiguous()
        wsum = w.qweight.to(torch.int32).sum(dim=1).to(torch.int32).contiguous()
        return NativeState("w8a8", (w.qweight.contiguous(), w.scales.float().reshape(-1).contiguous(), wsum, inv), n, k)
    raise TypeError(f"no native kernel for {type(w).__name__}")


def native_linear(x: Tensor, st: NativeState, tensors: tuple[Tensor, ...] | None = None) -> Tensor:
    """y = x @ W^T through the native op for `st` (x [M, K] bf16|fp32). `tensors` overrides st.tensors (a module
    passes its registered buffers, so a traced graph takes them as inputs)."""
    t = st.tensors if tensors is None else tensors
    o = ops()
    if st.kind == "int8":
        return o.int8_linear(x, t[0], t[1])  # type: ignore[attr-defined,no-any-return]
    if st.kind == "intn":
        return o.intn_linear(x, t[0], st.n, st.k, st.bits, st.group_size)  # type: ignore[attr-defined,no-any-return]
    return o.w8a8_linear(x, t[0], t[1], t[2], t[3])  # type: ignore[attr-defined,no-any-return]


def native_weight_bytes(st: NativeState) -> int:
    """Bytes one decode step reads for this layer through the native kernel (padding rows excluded)."""
    if st.kind == "intn":
        return int(st.tensors[0].shape[1]) * st.n
    return sum(t.numel() * t.element_size() for t in st.tensors)
