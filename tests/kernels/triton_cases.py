"""Triton kernel checks, run as a script in a child process with TRITON_INTERPRET=1 (see test_kernels_triton.py).

Triton decides interpreter vs. compiled mode from the environment when kernels are defined, so the variable has
to be set before anything imports triton; a fresh process is the only way to guarantee that whatever the
parent pytest process has already imported. Prints {case_id: {"max_rel", "fro_rel"} | {"error"}} as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

# (format spec, N, K): N=72 leaves a partial BLOCK_N tile, K=192 runs several BLOCK_K iterations.
SHAPES: tuple[tuple[str, int, int], ...] = (
    ("int8", 72, 192),
    ("int8-g64", 72, 192),
    ("int4-g64", 72, 192),
    ("int4s-g32", 72, 192),
    ("int4-g128", 40, 256),
    ("int2-g128", 40, 256),
    ("w8a8", 72, 192),
)
MS: tuple[int, ...] = (1, 3, 17)
KERNELS: tuple[str, ...] = ("gemv", "gemm")
# Small tiles so tiny shapes still exercise tails and K loops (production tiles live in ops.py).
BLOCKS = {"gemv": {"BLOCK_N": 32, "BLOCK_K": 64}, "gemm": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}}


def case_ids() -> list[str]:
    return [f"{spec}-{n}x{k}-M{m}-{kern}" for spec, n, k in SHAPES for m in MS for kern in KERNELS]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("TRITON_INTERPRET=1 must be set before launching this script", file=sys.stderr)
        return 2
    import torch

    from glowplug.kernels import formats as F
    from glowplug.kernels import reference as R
    from glowplug.kernels.dispatch import kernel_paths
    from glowplug.kernels.triton import ops

    results: dict[str, dict[str, object]] = {}
    for spec, n, k in SHAPES:
        gen = torch.Generator().manual_seed(n * k)
        w = F.quantize(torch.randn(n, k, generator=gen) * 0.05, spec)
        if spec == "w8a8":  # with smoothing, to cover the 1/s pre-scale
            w = F.quantize_w8a8(torch.randn(n, k, generator=gen) * 0.05, torch.rand(k, generator=gen) + 0.5)
        st = ops.prepare(w)
        for m in MS:
            x = torch.randn(m, k, generator=gen)
            ref = R.linear(x, w)
            for kern in KERNELS:
                cid = f"{spec}-{n}x{k}-M{m}-{kern}"
                try:
                    y = getattr(ops, kern)(x, st, BLOCKS[kern])
                    diff = (y.float() - ref).abs()
                    results[cid] = {
                        "max_rel": float(diff.max() / ref.abs().max()),
                        "fro_rel": float((y.float() - ref).norm() / ref.norm()),
                        "dtype": str(y.dtype),
                        "shape": list(y.shape),
                    }
                except Exception:  # noqa: BLE001 - reported per case so one broken kernel does not hide the others
                    results[cid] = {"error": traceback.format_exc()}
    # The dispatcher's triton entries wrap the same launchers and accept CPU tensors under the interpreter.
    w = F.quantize(torch.randn(64, 128) * 0.05, "int4-g32")
    x = torch.randn(2, 128)
    path = kernel_paths()["triton_gemv"]
    results["dispatch-entry"] = {
        "supports": bool(path.supports(w)),
        "max_rel": float(
            (path.run(x, path.prepare(w), None) - R.linear(x, w)).abs().max() / R.linear(x, w).abs().max()
        ),
    }
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
