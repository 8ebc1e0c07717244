"""Kernel micro-benchmarks: every valid path per (shape, format, M), plus what the dispatcher would pick.

Weights are rotated through enough copies to exceed the last-level cache (see dispatch.streamed_copies), since
in a real decode step every layer's weights come from DRAM. GB/s counts the bytes the path really reads: the
tensors of its prepared layout (`path_read_bytes`), not the format's canonical storage. int2 runs through aten's
int4 kernel with its codes widened to 4 bits, so it reads int4's bytes, not 2-bit storage; the canonical bytes are
a column of their own. GFLOP/s counts 2*M*N*K.

Besides the dispatcher's eager paths, every format the compiled decode step runs through glowplug's native
kernels (kernels/native.py: blocked bf16, int8/int4/int2 and VNNI w8a8) gets a `native (<ISA level>)` row when they
load here: the level of the variant this process loaded (one per process; `bench kernels --isa-levels` runs a child
process per level for the others).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .cpu import run_bf16_linear
from .dispatch import (
    DEFAULT_MS,
    Dispatcher,
    default_dispatcher,
    measure_path_samples,
    streamed_copies,
    time_samples_us,
)
from .formats import fit_spec, quantize

# Every format and group the engine runs: int4-g32 is the default model's (its GGUF source's 32-weight blocks);
# -g128 requests become g64 on the K=576 layers (fit_spec), as in the engine.
DEFAULT_BENCH_FORMATS: tuple[str, ...] = (
    "bf16",
    "int8",
    "int8-g64",
    "int8-g128",
    "int4-g32",
    "int4-g64",
    "int4-g128",
    "int2-g64",
    "int2-g128",
    "w8a8",
)


def _unique_tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of the distinct tensors reachable from a state (dataclass fields, tuples, lists)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = obj.data_ptr()
        if key in seen or obj.numel() == 0:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_unique_tensor_bytes(getattr(obj, f), seen) for f in obj.__dataclass_fields__)
    if isinstance(obj, (tuple, list)):
        return sum(_unique_tensor_bytes(o, seen) for o in obj)
    return 0


def path_read_bytes(state: Any) -> int:
    """Weight bytes one call of a path reads from its prepared state. The dequant state keeps the canonical weight
    for its codes but reads its own converted scales and zeros, so only the codes of that weight count."""
    from .cpu import DequantState

    if isinstance(state, DequantState):
        own = [state.weight.qweight, state.scales, state.zeros, state.post_scale]
        return _unique_tensor_bytes([t for t in own if t is not None])
    return _unique_tensor_bytes(state)


def _bf16_row_timings(
    n: int, k: int, ms: Sequence[int], repeats: int, stream_bytes: int, seed: int
) -> dict[int, list[float]]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    copies = [w] + [w.clone() for _ in range(streamed_copies(w.numel() * 2, stream_bytes) - 1)]
    out: dict[int, list[float]] = {}
    for m in ms:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        out[m] = time_samples_us(_rotating_bf16(x, copies), repeats=repeats)
    return out


def _rotating_bf16(x: torch.Tensor, copies: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    counter = [0]

    def call() -> torch.Tensor:
        counter[0] = (counter[0] + 1) % len(copies)
        return run_bf16_linear(x, copies[counter[0]])

    return call


def bench_kernels(
    shapes: list[tuple[int, int]],
    ms: Sequence[int] = DEFAULT_MS,
    formats: Sequence[str] = DEFAULT_BENCH_FORMATS,
    repeats: int = 10,
    *,
    dispatcher: Dispatcher | None = None,
    stream_bytes: int = 96 << 20,
    seed: int = 0,
    native: bool = False,
    native_only: bool = False,
) -> list[dict[str, Any]]:
    """One row per (shape (N, K), format spec, M, path): us (the median call), us_min, us_max, samples (calls
    timed), gbps and gflops (at the median), read_bytes, canonical_bytes, chosen (the dispatcher's pick for that M,
    which ranks paths by their fastest call) and dispatch (the picked path's name). A group size that does not
    divide K is lowered the way the registry lowers it per layer, and the row is labelled with the group actually
    used (int4-g128 on K=576 is reported as int4-g64). 'bf16' is the unquantized baseline (path 'bf16_linear')."""
    disp = dispatcher if dispatcher is not None else default_dispatcher()
    rows: list[dict[str, Any]] = []
    for n, k in shapes:
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(n, k, generator=gen)
        for spec in dict.fromkeys(s if s == "bf16" else fit_spec(s, k) for s in formats):
            label = native_label()
            if spec == "bf16":
                timings = (
                    {}
                    if native_only
                    else {
                        m: {"bf16_linear": us}
                        for m, us in _bf16_row_timings(n, k, ms, repeats, stream_bytes, seed).items()
                    }
                )
                nbytes, picks = n * k * 2, dict.fromkeys(ms, "bf16_linear")
                read = {"bf16_linear": nbytes}
                w_native: Any = weight.to(torch.bfloat16)
            else:
                w = w_native = quantize(weight, spec)
                nbytes = sum(t.numel() * t.element_size() for t in w.tensors().values())
                timings = (
                    {}
                    if native_only
                    else measure_path_samples(disp, w, ms, repeats=repeats, stream_bytes=stream_bytes, seed=seed)
                )
                rt = disp.prepare(w, disp.valid_paths(w))
                read = {name: path_read_bytes(state) for name, state in rt.states.items()}
                picks = {m: disp.choose(disp.prepare(w), m) for m in ms}
            if native or native_only:
                for m, samples, nb in _native_timings(w_native, ms, repeats, stream_bytes, seed):
                    timings.setdefault(m, {})[label] = samples
                    read[label] = nb
            for m, per_path in timings.items():
                for path, samples in per_path.items():
                    rb = read.get(path, nbytes)
                    us = statistics.median(samples)
                    rows.append(
                        {
                            "shape": f"{n}x{k}",
                            "n": n,
                            "k": k,
                            "format": spec,
                            "m": m,
                            "path": path,
                            "us": us,
                            "us_min": min(samples),
                            "us_max": max(samples),
                            "samples": len(samples),
                            "gbps": rb / us / 1e3,
                            "read_bytes": rb,
                            "canonical_bytes": nbytes,
                            "gflops": 2 * m * n * k / us / 1e3,
                            "chosen": path == picks[m],
                            "dispatch": picks[m],
                        }
                    )
    return rows


def native_available(cache_dir: Any = None) -> tuple[bool, str]:
    """Whether glowplug's native kernels load on this machine (building them into the cache if needed), and why."""
    from pathlib import Path

    from .native import load_native

    build = load_native(Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "glowplug")
    if not build.available:
        return False, build.reason
    return True, f"{build.reason}, ISA {build.level_reason}"


def native_label() -> str:
    """The native rows' path name: "native (<ISA level>)", the level of the variant this process loaded."""
    from .native import loaded_level

    return f"native ({loaded_level() or '?'})"


def _native_timings(
    w: Any, ms: Sequence[int], repeats: int, stream_bytes: int, seed: int
) -> list[tuple[int, list[float], int]]:
    """(M, every call's µs, bytes read) of the native kernel the compiled decode step uses for this weight (a
    packed format, or a dense bf16 tensor: the blocked bf16 kernel; none: [])."""
    from .native import native_linear, ops, pack_blocked, prepare_native

    if isinstance(w, torch.Tensor):
        n = w.shape[0]
        packs = [pack_blocked(w)[0]] + [
            pack_blocked(w.clone())[0] for _ in range(streamed_copies(w.numel() * 2, stream_bytes) - 1)
        ]
        nbytes = packs[0].numel() * packs[0].element_size()

        def kernel(x: torch.Tensor, i: int) -> torch.Tensor:
            return ops().dense_blocked(x, packs[i], n)  # type: ignore[attr-defined,no-any-return]

        count = len(packs)
    else:
        state = prepare_native(w, torch.bfloat16)
        if state is None:
            return []
        states = [state] + [
            prepare_native(_clone_weight(w), torch.bfloat16)
            for _ in range(streamed_copies(state.nbytes, stream_bytes) - 1)
        ]
        nbytes, count = state.nbytes, len(states)

        def kernel(x: torch.Tensor, i: int) -> torch.Tensor:
            st = states[i]
            assert st is not None
            return native_linear(x, st)

    gen = torch.Generator().manual_seed(seed)
    out = []
    for m in ms:
        x = torch.randn(m, w.shape[1], generator=gen).to(torch.bfloat16)
        counter = [0]

        def call(x: torch.Tensor = x, counter: list[int] = counter) -> torch.Tensor:
            counter[0] = (counter[0] + 1) % count
            return kernel(x, counter[0])

        out.append((m, time_samples_us(call, repeats=repeats), nbytes))
    return out


def _clone_weight(w: Any) -> Any:
    import dataclasses

    return dataclasses.replace(
        w,
        **{
            f.name: getattr(w, f.name).clone()
            for f in dataclasses.fields(w)
            if isinstance(getattr(w, f.name), torch.Tensor)
        },
    )


def _us_cell(r: dict[str, Any]) -> str:
    """Median µs with the min–max of the calls, or n=1 (rows from older JSON have "us" alone)."""
    if r.get("samples", 1) <= 1 or "us_min" not in r:
        return f"{r['us']:.1f} (n=1)"
    return f"{r['us']:.1f} ({r['us_min']:.1f}–{r['us_max']:.1f})"


def render_markdown(rows: list[dict[str, Any]], flags: dict[str, str] | None = None) -> str:
    """A markdown table, one line per measured path, the dispatcher's choice marked with '*'."""
    head = (
        "| shape (NxK) | format | M | path | µs, median (min–max) | calls | KiB read | KiB stored "
        "| GB/s read (median) | GFLOP/s (median) | chosen |"
        "\n|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for r in sorted(rows, key=lambda r: (r["n"] * r["k"], r["shape"], r["format"], r["m"], r["us"])):
        mark = "*" if r["chosen"] else ""
        scheme = r["format"].split("-")[0]  # "int2-g64" -> the scheme the accuracy report judged, "int2"
        flag = (" " + flags[scheme]) if flags and scheme in flags else ""
        rb, cb = r.get("read_bytes", r.get("canonical_bytes", 0)), r.get("canonical_bytes", 0)
        lines.append(
            f"| {r['shape']} | {r['format']}{flag} | {r['m']} | {r['path']} | {_us_cell(r)} "
            f"| {r.get('samples', 1)} | {rb / 1024:.0f} | {cb / 1024:.0f} | {r['gbps']:.3g} | {r['gflops']:.3g} "
            f"| {mark} |"
        )
    return "\n".join(lines) + "\n"
