"""Per-token mask cost and grammar compile time of xgrammar and llguidance at a real vocabulary.

Builds the tokenizer glowplug builds for a GGUF (engine/models/gguf_meta.build_tokenizer; Qwen2.5's 151k tokens by
default), then for each library: the tokenizer's grammar info, one JSON schema's compile (cold, then repeated), and
the mask of every step while the matcher walks a valid instance of the schema token by token. Run:

    .venv/bin/python scripts/grammar_lib_cost.py [--gguf PATH] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "tags": ["math", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y"},
    "active": True,
}


def ms(xs: list[float]) -> str:
    xs = sorted(xs)
    p50, p99 = xs[len(xs) // 2], xs[int(len(xs) * 0.99)]
    return f"mean {statistics.mean(xs) * 1e3:.3f} ms, p50 {p50 * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default="/work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from tokenizers import Tokenizer

    from glowplug.engine.models.gguf_meta import build_tokenizer, open_reader

    t0 = time.perf_counter()
    tok_json, tok_cfg = build_tokenizer(open_reader(Path(args.gguf)), Path(args.gguf))
    backend = Tokenizer.from_str(tok_json)
    print(
        f"tokenizer from {Path(args.gguf).name}: {backend.get_vocab_size()} tokens ({time.perf_counter() - t0:.1f} s)"
    )
    vocab = backend.get_vocab(with_added_tokens=True)
    n_vocab = max(vocab.values()) + 1
    eos = vocab.get(tok_cfg.get("eos_token") or "<|im_end|>", vocab.get("<|endoftext|>"))
    text = json.dumps(INSTANCE)
    ids = backend.encode(text, add_special_tokens=False).ids + [eos]
    print(f"instance: {len(ids)} tokens; schema: {len(json.dumps(SCHEMA))} chars")

    # --- xgrammar
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    strs = [""] * n_vocab
    for t, i in vocab.items():
        strs[i] = t
    info = xgr.TokenizerInfo(strs, xgr.VocabType.BYTE_LEVEL, vocab_size=n_vocab, stop_token_ids=[eos])
    t_info = time.perf_counter() - t0
    t0 = time.perf_counter()
    blob = info.serialize_json()
    t_ser = time.perf_counter() - t0
    t0 = time.perf_counter()
    xgr.TokenizerInfo.deserialize_json(blob)
    t_de = time.perf_counter() - t0
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    t_warm = time.perf_counter() - t0
    masks: list[float] = []
    applies: list[float] = []
    logits = torch.randn(1, n_vocab)
    for _ in range(args.repeats):
        m = xgr.GrammarMatcher(compiled)
        bm = xgr.allocate_token_bitmask(1, n_vocab)
        for t in ids:
            a = time.perf_counter()
            m.fill_next_token_bitmask(bm, 0)
            masks.append(time.perf_counter() - a)
            lg = logits.clone()
            a = time.perf_counter()
            xgr.apply_token_bitmask_inplace(lg, bm)
            applies.append(time.perf_counter() - a)
            assert m.accept_token(t), t
        assert m.is_terminated()
    print(
        f"xgrammar: tokenizer info {t_info * 1e3:.0f} ms (serialize {t_ser * 1e3:.0f} ms, {len(blob) / 1e6:.1f} MB; "
        f"deserialize {t_de * 1e3:.0f} ms); schema compile cold {t_cold * 1e3:.1f} ms, repeated {t_warm * 1e3:.2f} ms"
    )
    print(f"xgrammar: mask per token {ms(masks)}; apply {ms(applies)}")

    # --- llguidance
    import llguidance
    import llguidance.torch as lltorch

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok_json, n_vocab=n_vocab, eos_token=eos)
    t_info = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    )
    m = llguidance.LLMatcher(lltok, grammar)
    t_cold = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    t0 = time.perf_counter()
    llguidance.LLMatcher(lltok, grammar)
    t_warm = time.perf_counter() - t0
    masks = []
    for _ in range(args.repeats):
        m = llguidance.LLMatcher(lltok, grammar)
        bm = lltorch.allocate_token_bitmask(1, n_vocab)
        for t in ids:
            a = time.perf_counter()
            lltorch.fill_next_token_bitmask(m, bm, 0)
            masks.append(time.perf_counter() - a)
            assert m.consume_token(t), (t, m.get_error())
        assert m.is_stopped() or m.is_accepting()
    print(
        f"llguidance: tokenizer {t_info * 1e3:.0f} ms; schema to matcher cold {t_cold * 1e3:.1f} ms, "
        f"repeated {t_warm * 1e3:.2f} ms (no compile step: the mask is computed lazily)"
    )
    print(f"llguidance: mask per token {ms(masks)}")
    # Applying the masks to their rows (glowplug's sampler), on one torch thread: on a machine shared with other jobs,
    # torch's thread pool waiting on busy cores swamps a call this small (the two-thread figure is printed too).
    from glowplug.engine.sampler import apply_token_bitmask

    bm = xgr.allocate_token_bitmask(8, n_vocab)
    m = xgr.GrammarMatcher(compiled)
    for r in range(8):
        m.fill_next_token_bitmask(bm, r)

    def applies() -> list[float]:
        """50 timings of masking 8 rows of a batch of 16 fresh logits rows."""
        times: list[float] = []
        for _ in range(50):
            lg = torch.randn(16, n_vocab)
            a = time.perf_counter()
            apply_token_bitmask(lg, bm.numpy(), list(range(0, 16, 2)))
            times.append(time.perf_counter() - a)
        return times

    threads = f"{torch.get_num_threads()} threads"
    for label in (threads, "1 thread"):
        if label == "1 thread":
            torch.set_num_threads(1)
        print(f"glowplug apply_token_bitmask, 8 masked rows of a batch of 16, {label}: {ms(applies())}")
    words = (n_vocab + 31) // 32
    print(f"bitmask words per row: {words} int32 ({np.dtype(np.int32).itemsize * words} B)")


if __name__ == "__main__":
    main()
