"""`glowplug bench decode`: decode tokens/s of the engine per batch size and quantization, against transformers'
`generate` on the same model and prompts, with the weight traffic set against the machine's measured bandwidth.

Only decode steps are timed: the clock starts once every sequence of the batch has its first token (prefill done)
and stops when the batch finishes. transformers' decode time is generate(N tokens) minus generate(1 token) on the
same inputs, so its prefill is excluded the same way.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...engine.config import EngineConfig
from .machine import measure_memory_bandwidth, report_header

PROMPT_WORDS = (
    "glowplug", "schedules", "prefill", "chunks", "while", "decode", "steps", "stream", "tokens", "from", "a",
    "paged", "cache", "of", "blocks", "that", "share", "prefixes", "and", "free", "on", "abort",
)  # fmt: skip


class DecodeBenchConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = "smollm2"
    batch_sizes: tuple[int, ...] = Field((1, 8, 32), min_length=1)
    quantization: tuple[Literal["none", "int8", "int4", "int2", "w8a8"], ...] = ("none",)
    prompt_tokens: int = Field(64, ge=1, le=4096)
    new_tokens: int = Field(32, ge=4, le=4096)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    compare_hf: bool = True
    out: Path | None = None


@dataclass
class DecodeRow:
    engine: str
    quantization: str
    batch: int
    tokens_per_s: float
    step_ms: float
    weight_mb_per_step: float | None = None
    achieved_gbps: float | None = None
    bandwidth_fraction: float | None = None


def make_prompts(tokenizer: Any, batch: int, prompt_tokens: int) -> list[list[int]]:
    """`batch` distinct prompts of exactly `prompt_tokens` tokens each (no prefix sharing between them)."""
    prompts = []
    for b in range(batch):
        words = [PROMPT_WORDS[(b * 7 + i * 3) % len(PROMPT_WORDS)] for i in range(prompt_tokens)]
        ids = list(tokenizer(f"Request {b}: " + " ".join(words))["input_ids"])[:prompt_tokens]
        prompts.append(ids + ids[: prompt_tokens - len(ids)])
    return prompts


def weight_bytes_per_step(model: Any) -> int:
    """Bytes of weights a decode step streams: every parameter/buffer except the embedding rows it does not read
    (a tied embedding is read in full once, as the LM head)."""
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("rotary_emb.cos") or name.endswith("rotary_emb.sin"):
            continue
        total += t.numel() * t.element_size()
    return total


def time_engine_decode(engine: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(decode tokens/s, ms per decode step) for one batch run to completion."""
    from ...engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    reqs = [engine.add_request(None, params, prompt_token_ids=p) for p in prompts]
    seqs = [s for r in reqs for s in r.seqs]
    while engine.has_unfinished() and not all(s.output_token_ids for s in seqs):
        engine.step()
    tokens0 = sum(len(s.output_token_ids) for s in seqs)
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - t0
    generated = sum(len(s.output_token_ids) for s in seqs) - tokens0
    return generated / elapsed, elapsed / max(steps, 1) * 1000


def time_hf_decode(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[float, float]:
    import torch

    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=pad_id)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        t2 = time.perf_counter()
    decode = (t2 - t1) - (t1 - t0)
    steps = new_tokens - 1
    return len(prompts) * steps / decode, decode / steps * 1000


def run_decode_bench(cfg: DecodeBenchConfig) -> tuple[list[DecodeRow], float]:
    from ...engine.llm import LLM

    bandwidth = measure_memory_bandwidth()
    rows: list[DecodeRow] = []
    model_dir = None
    longest = cfg.prompt_tokens + cfg.new_tokens
    for quant in cfg.quantization:
        llm = LLM(
            config=EngineConfig.from_flat(
                model=cfg.model,
                dtype=cfg.dtype,
                quantization=quant,
                max_model_len=longest,
                max_num_seqs=max(cfg.batch_sizes),
                max_num_batched_tokens=max(2048, cfg.prompt_tokens),
            )
        )
        model_dir = llm.startup.model_dir
        wbytes = weight_bytes_per_step(llm.startup.context.model)  # type: ignore[arg-type]
        for batch in cfg.batch_sizes:
            prompts = make_prompts(llm.tokenizer, batch, cfg.prompt_tokens)
            tps, step_ms = time_engine_decode(llm.engine, prompts, cfg.new_tokens)
            gbps = wbytes / (step_ms / 1000) / 1e9
            rows.append(DecodeRow("glowplug", quant, batch, tps, step_ms, wbytes / 1e6, gbps, gbps / bandwidth))
        del llm
    if cfg.compare_hf and model_dir is not None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = torch.float32 if cfg.dtype in ("auto", "float32") else getattr(torch, cfg.dtype)
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        for batch in cfg.batch_sizes:
            tps, step_ms = time_hf_decode(hf, make_prompts(tok, batch, cfg.prompt_tokens), cfg.new_tokens, pad)
            rows.append(DecodeRow("transformers", "none", batch, tps, step_ms))
    return rows, bandwidth


def render_markdown(rows: list[DecodeRow], bandwidth: float, cfg: DecodeBenchConfig, argv: list[str] | None) -> str:
    hf = {r.batch: r.tokens_per_s for r in rows if r.engine == "transformers"}
    lines = [
        report_header("Decode throughput", argv),
        f"Model `{cfg.model}`, dtype {cfg.dtype}, {cfg.prompt_tokens} prompt tokens, {cfg.new_tokens} new tokens "
        f"per sequence, greedy. Measured streaming-read bandwidth in the same run: **{bandwidth:.1f} GB/s**.",
        "",
        "| engine | quantization | batch | decode tok/s | ms / step | weight MB / step | achieved GB/s "
        "| % of bandwidth | vs transformers |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r.tokens_per_s / hf[r.batch]:.2f}x" if r.engine == "glowplug" and r.batch in hf else ""
        mb = f"{r.weight_mb_per_step:.0f}" if r.weight_mb_per_step is not None else ""
        gb = f"{r.achieved_gbps:.1f}" if r.achieved_gbps is not None else ""
        frac = f"{100 * r.bandwidth_fraction:.0f}%" if r.bandwidth_fraction is not None else ""
        lines.append(
            f"| {r.engine} | {r.quantization} | {r.batch} | {r.tokens_per_s:.1f} | {r.step_ms:.1f} | {mb} | {gb} "
            f"| {frac} | {ratio} |"
        )
    lines += [
        "",
        "Decode time excludes prefill for both engines (see `profiling/bench/decode.py`). Achieved GB/s counts "
        "the weight bytes one decode step streams (KV-cache reads not included).",
        "",
    ]
    return "\n".join(lines)


def rows_as_dicts(rows: list[DecodeRow]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
