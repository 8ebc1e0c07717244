"""Time the native gguf_linear op of this tree per (GGUF type, N, K, M): one JSON line per case.

    CASES=3x1536x576,8x49152x576 ROT=120 THREADS=2 python scripts/gguf_linear_micro.py 1,8,16,64

CASES: TYPExNxK (ggml type ids: 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K). The weights
rotate through copies of random stored rows, ROT x 1536 x 576 weights in all (120: about 66 MB of Q4_1, past the
last-level cache), so a call reads them from DRAM as a decode step does. Per case: the fastest and the median of 12
timed passes over the copies. For an A/B, run it from each tree in turn (each loads its own kernels).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))


def main() -> None:
    from test_native_gguf import stored_rows

    from glowplug.kernels.native import load_native

    build = load_native(Path(tempfile.mkdtemp()))
    if not build.available:
        raise SystemExit(f"the native kernels are unavailable: {build.reason}")
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    e8, e32 = torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int32)
    spec = os.environ.get("CASES", "3x1536x576,3x576x1536,3x960x576,8x576x1536,6x1536x576,2x1536x576")
    cases = [tuple(int(v) for v in c.split("x")) for c in spec.split(",")]
    rows_m = [int(m) for m in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 4, 16, 64]
    rot = int(os.environ.get("ROT", "8"))
    for t, n, k in cases:
        copies = [stored_rows(t, n, k, s) for s in range(max(2, rot * 1536 * 576 // (n * k)))]
        for m in rows_m:
            x = torch.randn(m, k).bfloat16()

            def call(w: torch.Tensor, x: torch.Tensor = x, t: int = t) -> None:
                torch.ops.glowplug_native.gguf_linear(x, w, t, e32, e8, 0, e32, e8, 0, e32)

            for w in copies:
                call(w)
            times = []
            for _ in range(12):
                t0 = time.perf_counter()
                for w in copies:
                    call(w)
                times.append((time.perf_counter() - t0) / len(copies) * 1e6)
            times.sort()
            line = {"type": t, "n": n, "k": k, "m": m, "us_min": round(times[0], 1), "us_med": round(times[6], 1)}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
