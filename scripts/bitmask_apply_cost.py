"""The sampler's grammar masking (engine/sampler.py `apply_token_bitmask`) against the masked_fill it replaced: 8
constrained rows of a batch of 16, at SmolLM2's (49,152) and Qwen2.5's (151,936) vocabularies, with one torch
thread and two, on a sparse mask (a grammar's usual: a few allowed tokens) and a random one (half allowed). Run:

    .venv/bin/python scripts/bitmask_apply_cost.py [--repeats 60]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from glowplug.engine.sampler import apply_token_bitmask


def masked_fill_apply(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> torch.Tensor:
    """The previous implementation: unpack the allowed bits, compare, one masked_fill per row."""
    vocab = logits.shape[-1]
    bits = np.unpackbits(np.ascontiguousarray(bitmask[: len(rows)]).view(np.uint8), axis=-1, bitorder="little")
    if bits.shape[-1] < vocab:
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[-1])))
    banned = torch.from_numpy(bits[:, :vocab] == 0)
    for j, row in enumerate(rows):
        logits[row].masked_fill_(banned[j], float("-inf"))
    return logits


def main() -> None:
    import time

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = list(range(0, 16, 2))
    print(f"load average {os.getloadavg()[0]:.2f}; 8 of 16 rows constrained, float32 logits; ms per call, p10 / p50")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for vocab in (49152, 151936):
            words = (vocab + 31) // 32
            for kind in ("sparse", "random"):
                if kind == "sparse":
                    mask = np.zeros((8, words), np.int32)
                    mask[:, rng.integers(0, words, 40)] = 1 << 3
                else:
                    mask = rng.integers(-(2**31), 2**31, size=(8, words), dtype=np.int64).astype(np.int32)
                base = torch.randn(16, vocab)
                times: dict[str, list[float]] = {"masked_fill": [], "apply_token_bitmask": []}
                for _ in range(args.repeats):  # interleaved, so drift hits both alike
                    for name, fn in (("masked_fill", masked_fill_apply), ("apply_token_bitmask", apply_token_bitmask)):
                        x = base.clone()
                        t0 = time.perf_counter()
                        fn(x, mask, rows)
                        times[name].append((time.perf_counter() - t0) * 1e3)
                cells = []
                for name, ts in times.items():
                    ts.sort()
                    cells.append(f"{name} {ts[len(ts) // 10]:.2f} / {ts[len(ts) // 2]:.2f}")
                print(f"threads {threads}, vocab {vocab}, {kind}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
