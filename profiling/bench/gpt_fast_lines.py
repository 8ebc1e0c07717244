"""Seed 003's per-run lines (gpt-fast / torchao `generate.py`): one line per timed run, in its vocabulary.

    20240831225155, tok/s=107.38, mem/s=1418.93 GB/s, peak_mem=13.88 GB, model_size=13.21 GB quant: None, ...
    ... kv_quant: False, compile: True, ... dtype: torch.bfloat16, device: cuda repro: python generate.py ...

The same fields here, from the run itself (not the cell's median): tok/s is that run's decode tok/s, mem/s its
model_size over its ms / step (weights only, as gpt-fast's), peak_mem its RSS high-water mark. Added: the group
size, the context and cache size (seed 003's --cache_size sweep is glowplug's --max-model-len), the batch, and a
repro command that reruns just this cell. The seed glued `--cache_size 8192--kv_cache_quantization` together;
here every flag is its own argv item, joined by spaces.
"""

from __future__ import annotations

import shlex
from typing import Any

FLOAT_QUANT = {"none": "None"}  # gpt-fast prints the unquantized run as quant: None


def repro_argv(row: Any, cfg: Any) -> list[str]:
    """`glowplug bench decode` narrowed to this row's cell, one repeat."""
    argv = [
        "glowplug",
        "bench",
        "decode",
        cfg.model,
        "--dtype",
        row.dtype,
        "--quantization",
        row.quantization,
        "--kv-cache-dtype",
        row.kv_cache_dtype,
        "--compile",
        row.compile,
        "--batch-sizes",
        str(row.batch),
        "--prompt-tokens",
        str(row.context),
        "--new-tokens",
        str(cfg.new_tokens),
        "--repeats",
        "1",
    ]
    if row.max_model_len:
        argv += ["--max-model-len", str(row.max_model_len)]
    if cfg.group_size is not None and row.quantization in ("int8", "int4", "int2"):
        argv += ["--group-size", str(cfg.group_size)]
    if not cfg.quantize_lm_head:
        argv.append("--no-quantize-lm-head")
    return [*argv, "--no-compare-hf"]


def run_lines(row: Any, cfg: Any, device: str) -> list[str]:
    """One line per timed run of a measured glowplug row."""
    if row.skipped or row.mb_per_token is None:
        return []
    repro = shlex.join(repro_argv(row, cfg))
    out = []
    for i, (tps, ms) in enumerate(zip(row.tokens_per_s, row.step_ms)):
        stamp = row.run_at[i] if i < len(row.run_at) else "-"
        peak = f"{row.peak_gb[i]:5.2f} GB" if i < len(row.peak_gb) else "n/a"
        out.append(
            f"{stamp}, tok/s={tps:7.2f}, mem/s={row.mb_per_token / ms:7.2f} GB/s, peak_mem={peak}, "
            f"model_size={row.mb_per_token / 1e3:5.3f} GB quant: {FLOAT_QUANT.get(row.quantization, row.quantization)}"
            f", group: {row.group_size}, mod: {cfg.model}, kv_quant: {row.kv_cache_dtype == 'int8'}, "
            f"compile: {row.compile == 'on'}, dtype: torch.{row.dtype}, device: {device}, batch: {row.batch}, "
            f"context: {row.context}, cache_size: {row.max_model_len} repro: {repro}"
        )
    return out
