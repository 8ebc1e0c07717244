"""Kernel micro-benchmarks: every valid path per (shape, format, M), plus what the dispatcher would pick.

Weights are rotated through enough copies to exceed the last-level cache (see dispatch.streamed_copies), since
in a real decode step every layer's weights come from DRAM. GB/s counts the format's canonical weight bytes
(codes + scales + zeros), i.e. the effective bandwidth of the weights the model needs, whichever layout a path
reads; GFLOP/s counts 2*M*N*K.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .cpu import run_bf16_linear
from .dispatch import (
    DEFAULT_MS,
    Dispatcher,
    default_dispatcher,
    measure_paths,
    streamed_copies,
    time_us,
)
from .formats import fit_spec, quantize

DEFAULT_BENCH_FORMATS: tuple[str, ...] = (
    "bf16", "int8", "int8-g64", "int4-g128", "int4-g64", "int2-g128", "int2-g64", "w8a8",
)


def _bf16_row_timings(n: int, k: int, ms: Sequence[int], repeats: int, stream_bytes: int, seed: int
                      ) -> dict[int, float]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    copies = [w] + [w.clone() for _ in range(streamed_copies(w.numel() * 2, stream_bytes) - 1)]
    out: dict[int, float] = {}
    for m in ms:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        out[m] = time_us(_rotating_bf16(x, copies), repeats=repeats)
    return out


def _rotating_bf16(x: torch.Tensor, copies: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    counter = [0]

    def call() -> torch.Tensor:
        counter[0] = (counter[0] + 1) % len(copies)
        return run_bf16_linear(x, copies[counter[0]])

    return call


def bench_kernels(shapes: list[tuple[int, int]], ms: Sequence[int] = DEFAULT_MS,
                  formats: Sequence[str] = DEFAULT_BENCH_FORMATS, repeats: int = 10, *,
                  dispatcher: Dispatcher | None = None, stream_bytes: int = 96 << 20, seed: int = 0
                  ) -> list[dict[str, Any]]:
    """One row per (shape (N, K), format spec, M, path): us, gbps, gflops, chosen (the dispatcher's pick for
    that M) and dispatch (the picked path's name). A group size that does not divide K is lowered the way the
    registry lowers it per layer, and the row is labelled with the group actually used (int4-g128 on K=576 is
    reported as int4-g64). 'bf16' is the unquantized baseline (path 'bf16_linear')."""
    disp = dispatcher if dispatcher is not None else default_dispatcher()
    rows: list[dict[str, Any]] = []
    for n, k in shapes:
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(n, k, generator=gen)
        for spec in dict.fromkeys(s if s == "bf16" else fit_spec(s, k) for s in formats):
            if spec == "bf16":
                timings = {m: {"bf16_linear": us} for m, us in
                           _bf16_row_timings(n, k, ms, repeats, stream_bytes, seed).items()}
                nbytes, picks = n * k * 2, dict.fromkeys(ms, "bf16_linear")
            else:
                w = quantize(weight, spec)
                nbytes = sum(t.numel() * t.element_size() for t in w.tensors().values())
                timings = measure_paths(disp, w, ms, repeats=repeats, stream_bytes=stream_bytes, seed=seed)
                rt = disp.prepare(w)
                picks = {m: disp.choose(rt, m) for m in ms}
            for m, per_path in timings.items():
                for path, us in per_path.items():
                    rows.append({
                        "shape": f"{n}x{k}", "n": n, "k": k, "format": spec, "m": m, "path": path,
                        "us": us, "gbps": nbytes / us / 1e3, "gflops": 2 * m * n * k / us / 1e3,
                        "chosen": path == picks[m], "dispatch": picks[m],
                    })
    return rows


def render_markdown(rows: list[dict[str, Any]]) -> str:
    """A markdown table, one line per measured path, the dispatcher's choice marked with '*'."""
    head = "| shape (NxK) | format | M | path | µs | GB/s | GFLOP/s | chosen |\n|---|---|---|---|---|---|---|---|"
    lines = [head]
    for r in sorted(rows, key=lambda r: (r["n"] * r["k"], r["shape"], r["format"], r["m"], r["us"])):
        mark = "*" if r["chosen"] else ""
        lines.append(f"| {r['shape']} | {r['format']} | {r['m']} | {r['path']} | {r['us']:.1f} | {r['gbps']:.3g} "
                     f"| {r['gflops']:.3g} | {mark} |")
    return "\n".join(lines) + "\n"
