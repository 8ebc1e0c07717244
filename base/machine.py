"""Facts about the machine every layer may ask for: the CPU's model name and feature flags, and the streaming-read
bandwidth probe (the decode step's memory ceiling and the start-up floor's read rate). Nothing here imports torch
at import time, so the CLI can check settings against the machine before the heavy imports."""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

PROBE_BYTES = 1 << 30
PROBE_REPEATS = 5


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (a cache factor and a report header), else what Python knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache  # a machine fact: read once (the eager projections ask per call, through cpu_has_native_bf16)
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


# ------------------------------------------------------------------------------------------------ ISA levels
# The native kernels are built once per level (kernels/native.py), each level's variant with the flags of that level
# only, and one is chosen at run time, as ggml and oneDNN do: the highest level the CPU has, or lower under a cap.
ISA_LEVELS: tuple[str, ...] = ("portable", "avx2", "avx512", "avx512_bf16", "amx")
ISA_CAP_ENV = "GLOWPLUG_MAX_CPU_ISA"
# /proc/cpuinfo flags a level needs, on top of the level below's.
_LEVEL_FLAGS: dict[str, tuple[str, ...]] = {
    "portable": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}
_X86 = ("x86_64", "amd64", "i386", "i686")


def on_x86(machine: str | None = None) -> bool:
    """Whether this (or `machine`'s) architecture is x86, where the levels above portable exist."""
    return (machine or platform.machine()).lower() in _X86


class IsaCapError(ValueError):
    """GLOWPLUG_MAX_CPU_ISA names no level."""


@dataclass(frozen=True)
class IsaChoice:
    """The level the native kernels run at: `level`, which is the CPU's own (`cpu_level`) unless a cap lowered it."""

    level: str
    cpu_level: str
    cap: str | None

    @property
    def reason(self) -> str:
        """Why this level, for the native_kernels row and span."""
        if self.cap is not None and self.level != self.cpu_level:
            return f"{self.level}: capped by {ISA_CAP_ENV}={self.cap} (the CPU has {self.cpu_level})"
        missing = next_level_missing(self.cpu_level)
        beyond = f"; {missing}" if missing else ""
        return f"{self.level}: the highest level this CPU has{beyond}"


def level_at_least(level: str, floor: str) -> bool:
    return ISA_LEVELS.index(level) >= ISA_LEVELS.index(floor)


def cpu_isa_level(flags: frozenset[str] | None = None, machine: str | None = None) -> str:
    """The highest level whose flags this CPU has ("portable" off x86)."""
    if not on_x86(machine):
        return "portable"
    have = cpu_flags() if flags is None else flags
    level = "portable"
    for name in ISA_LEVELS[1:]:
        if not all(f in have for f in _LEVEL_FLAGS[name]):
            break
        level = name
    return level


def next_level_missing(level: str) -> str:
    """What keeps this CPU off the level above `level` ("" at the top, or off x86)."""
    i = ISA_LEVELS.index(level)
    if i + 1 >= len(ISA_LEVELS) or not on_x86():
        return ""
    above = ISA_LEVELS[i + 1]
    lacking = [f for f in _LEVEL_FLAGS[above] if f not in cpu_flags()]
    return f"no {above} (lacks {', '.join(lacking)})"


def isa_cap() -> str | None:
    """GLOWPLUG_MAX_CPU_ISA, checked (unset or empty: no cap)."""
    raw = os.environ.get(ISA_CAP_ENV, "").strip().lower()
    if not raw:
        return None
    if raw not in ISA_LEVELS:
        raise IsaCapError(
            f"{ISA_CAP_ENV}={raw!r} is not an ISA level: set it to one of {', '.join(ISA_LEVELS)}, "
            "or unset it to use the CPU's highest"
        )
    return raw


def isa_choice() -> IsaChoice:
    """The level the native kernels run at on this machine, under the cap."""
    cpu = cpu_isa_level()
    cap = isa_cap()
    level = cpu if cap is None or level_at_least(cap, cpu) else cap
    return IsaChoice(level, cpu, cap)


def cpu_has_native_bf16() -> bool:
    """bf16 arithmetic in hardware (AVX512-BF16 or AMX) at the level the kernels run at (GLOWPLUG_MAX_CPU_ISA caps
    it): what makes bf16 the fast dtype on a CPU."""
    return level_at_least(isa_choice().level, "avx512_bf16")


def l3_cache_bytes(cpu_root: Path = Path("/sys/devices/system/cpu")) -> int | None:
    """The machine's last-level (L3) cache in bytes, every instance counted once (from sysfs: one entry per group of
    CPUs that share one), or None where sysfs does not say. A streaming probe must read several times this, or it
    times the cache instead of the memory."""
    seen: dict[str, int] = {}
    for index in sorted(cpu_root.glob("cpu[0-9]*/cache/index[0-9]*")):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            size = (index / "size").read_text().strip()
            shared = (index / "shared_cpu_list").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        nbytes = int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size)
        seen[shared] = nbytes
    return sum(seen.values()) if seen else None


PROBE_PASSES = 7  # passes per sustained measurement: a median of 7 leaves out up to 3 disturbed ones
PROBE_L3_MULTIPLE = 4  # the probe reads at least this many times the L3


def probe_size(l3_bytes: int | None, floor: int = PROBE_BYTES) -> int:
    """Bytes a sustained probe reads: `floor`, or PROBE_L3_MULTIPLE x the L3 when that is larger."""
    return max(floor, PROBE_L3_MULTIPLE * (l3_bytes or 0))


@dataclass(frozen=True)
class ProbeStats:
    """Streaming-read passes over one buffer, in GB/s, in the order they ran. `sustained` (the median) is what a
    share is quoted against: one pass that ran while the neighbours were idle (`fastest`) says what the memory can
    do, not what a run of several seconds gets."""

    passes_gbps: tuple[float, ...]
    size_bytes: int
    l3_bytes: int | None = None

    @property
    def sustained(self) -> float:
        return statistics.median(self.passes_gbps)

    @property
    def fastest(self) -> float:
        return max(self.passes_gbps)

    def describe(self) -> str:
        return describe_probe(self.size_bytes, self.l3_bytes, len(self.passes_gbps))


def describe_probe(size_bytes: int, l3_bytes: int | None, passes: int) -> str:
    """How a sustained probe is measured, for a report's header."""
    l3 = f", {size_bytes / l3_bytes:.0f}x the {l3_bytes / 2**20:.0f} MiB L3" if l3_bytes else ", L3 size unknown"
    return (
        f"torch sum over {size_bytes / 2**20:.0f} MiB of fp32{l3}; {passes} passes: sustained = their median, "
        "fastest = their maximum"
    )


def measure_probe_stats(passes: int = PROBE_PASSES, size_bytes: int | None = None, device: str = "cpu") -> ProbeStats:
    """Streaming-read bandwidth over `passes` torch sums of `size_bytes` of fp32 (default: PROBE_BYTES or
    PROBE_L3_MULTIPLE x the L3, the larger), with torch's own threads: the decode step's memory ceiling. On a GPU
    (`device` "cuda...") the same sum over 4x the bytes (far larger than any L2), timed with a synchronize on each
    side, after one untimed sum that loads the reduction kernel."""
    import torch

    on_gpu = device.startswith("cuda")
    l3 = None if on_gpu else l3_cache_bytes()
    n = (size_bytes if size_bytes is not None else probe_size(l3)) * (4 if on_gpu else 1)
    buf = torch.ones(n // 4, dtype=torch.float32, device=device)
    if on_gpu:
        buf.sum()
    out = []
    for _ in range(passes):
        if on_gpu:
            torch.cuda.synchronize(buf.device)
        t0 = time.perf_counter()
        buf.sum()
        if on_gpu:
            torch.cuda.synchronize(buf.device)
        out.append(n / (time.perf_counter() - t0) / 1e9)
    return ProbeStats(tuple(out), n, l3)


def measure_probe(repeats: int = PROBE_REPEATS, size_bytes: int = PROBE_BYTES, device: str = "cpu") -> float:
    """The fastest of `repeats` streaming-read passes (measure_probe_stats) in GB/s: what the memory can do at its
    best (the start-up floor's read rate). A share of a run's bandwidth is quoted against the sustained rate."""
    return measure_probe_stats(repeats, size_bytes, device).fastest


@dataclass(frozen=True)
class GpuFacts:
    """What compiled GPU code depends on: the GPU's name, its compute capability and the CUDA that torch was built
    with (Inductor's and Triton's kernels are built for these; another GPU or CUDA is another entry)."""

    name: str
    capability: str  # "9.0"
    cuda: str  # torch.version.cuda

    def label(self) -> str:
        return f"cuda/{self.name}/sm_{self.capability.replace('.', '')}/cuda-{self.cuda}"


def gpu_facts(device: str = "cuda") -> GpuFacts:
    """The facts of `device` (a CUDA device torch can see)."""
    import torch

    dev = torch.device(device)
    major, minor = torch.cuda.get_device_capability(dev)
    return GpuFacts(torch.cuda.get_device_name(dev), f"{major}.{minor}", str(torch.version.cuda))


# ------------------------------------------------------------------------------------------------ machine facts
# What a bundle records about the machine that made it (engine/bundle.py), and what a miss on an entry from a
# bundle compares (store.py `explain`): the facts a cache entry can depend on, as names a user recognises.
FACT_NAMES: dict[str, str] = {
    "torch": "torch",
    "glowplug_source": "glowplug source",
    "cpu": "cpu model",
    "isa": "cpu isa level",
    "arch": "architecture",
    "compiler": "c++ compiler",
    "device": "device",
}


def machine_facts(*, compiler: bool = True) -> dict[str, str]:
    """This machine's facts (FACT_NAMES), from package metadata and /proc: no torch import. `compiler` runs
    `$CXX --version` (a few ms), which a miss explanation skips."""
    import shutil
    import subprocess
    from importlib import metadata

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    choice = isa_choice()
    facts = {"torch": torch_version, "cpu": cpu_model(), "isa": choice.level, "arch": platform.machine().lower()}
    if choice.cap is not None and choice.level != choice.cpu_level:
        facts["isa"] = f"{choice.level} ({ISA_CAP_ENV}={choice.cap}; the CPU has {choice.cpu_level})"
    if compiler:
        cxx = shutil.which(os.environ.get("CXX", "g++"))
        version = ""
        if cxx is not None:
            try:
                out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=10, check=False)
                version = out.stdout.splitlines()[0] if out.stdout else cxx
            except (OSError, subprocess.SubprocessError):
                version = cxx
        facts["compiler"] = version or "none"
    return facts


def fact_changes(theirs: dict[str, str], ours: dict[str, str]) -> list[str]:
    """`cpu isa level: avx512_bf16 there, avx2 here` for each fact both sides know that differs."""
    out = []
    for key, name in FACT_NAMES.items():
        if key in theirs and key in ours and theirs[key] != ours[key]:
            out.append(f"{name}: {theirs[key]} there, {ours[key]} here")
    return out
