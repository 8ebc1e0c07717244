#!/usr/bin/env python3
"""GGUF files with a real model's exact tensor names, shapes and types, and random weights; and re-quantized
variants of any GGUF.

A real 7B checks memory, start-up and speed at a size this project cannot download, and small files of every
layout llama.cpp writes check the loader: neither needs real weights, only what llama.cpp's quantizer does to a
file of that shape. So the weights are written (random, F16, F32 or Q8_0) with the `gguf` package's writer, tensor
by tensor, so that memory holds one tensor at a time, and llama.cpp itself (llama-cpp-python's
`llama_model_quantize`) picks each tensor's type for the target ftype, as it does for the files users download.

    python scripts/synthetic_gguf.py random qwen2.5-7b OUT.gguf --tokenizer-from QWEN2.5-1.5B.gguf
    python scripts/synthetic_gguf.py requantize SRC.gguf OUT.gguf --ftype Q6_K
    python scripts/synthetic_gguf.py fixtures tests/data/gguf      # the loader tests' files
    python scripts/synthetic_gguf.py inspect FILE.gguf               # types per tensor, as gguf-dump lists them

Needs `gguf` and numpy (glowplug's own dependencies); quantizing needs llama-cpp-python, and the `fixtures`
tokenizer needs transformers (the `test` extra).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from pydantic import BaseModel, ConfigDict

Arch = Literal["llama", "qwen2", "qwen3", "gemma3"]
Stored = Literal["F32", "F16", "Q8_0"]
# llama.cpp's token types (llama_token_type): the converter pads a vocabulary to the embedding's rows with UNUSED.
TOKEN_UNUSED = 5
TOKEN_CONTROL = 3
TOKEN_NORMAL = 1
# Rows generated at once: bounds the fp32 scratch to about 64 MB whatever the tensor.
CHUNK_VALUES = 16 << 20


class ModelShape(BaseModel):
    """The hyperparameters that fix a model's tensors (names, shapes) and its GGUF metadata."""

    model_config = ConfigDict(frozen=True)

    arch: Arch
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int | None = None  # hidden // heads when None
    qkv_bias: bool = False  # Qwen2's q/k/v biases
    tied: bool = False  # no output.weight: the head is the embedding
    context: int = 4096
    rope_theta: float = 10000.0
    eps: float = 1e-6
    sliding_window: int | None = None  # Gemma 3

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


# Qwen2.5-7B(-Instruct)'s config.json: 28 layers, 3584 hidden, 18944 FFN, 28 heads of 128, 4 KV heads, q/k/v
# biases, an untied head, a 152064-row embedding (llama.cpp's converter pads the token list to it).
PRESETS: dict[str, ModelShape] = {
    "qwen2.5-7b": ModelShape(
        arch="qwen2",
        name="Qwen2.5 7B (synthetic)",
        layers=28,
        hidden=3584,
        ffn=18944,
        heads=28,
        kv_heads=4,
        vocab=152064,
        qkv_bias=True,
        tied=False,
        context=32768,
        rope_theta=1e6,
        eps=1e-6,
    ),
}


def tensors(s: ModelShape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [rows, cols]) of every tensor of `s`, in llama.cpp's order."""
    h, d = s.hidden, s.dim
    yield "token_embd.weight", (s.vocab, h)
    for i in range(s.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (h,)
        yield b + "attn_q.weight", (s.heads * d, h)
        yield b + "attn_k.weight", (s.kv_heads * d, h)
        yield b + "attn_v.weight", (s.kv_heads * d, h)
        if s.qkv_bias:
            yield b + "attn_q.bias", (s.heads * d,)
            yield b + "attn_k.bias", (s.kv_heads * d,)
            yield b + "attn_v.bias", (s.kv_heads * d,)
        if s.arch in ("qwen3", "gemma3"):
            yield b + "attn_q_norm.weight", (d,)
            yield b + "attn_k_norm.weight", (d,)
        yield b + "attn_output.weight", (h, s.heads * d)
        if s.arch == "gemma3":
            yield b + "post_attention_norm.weight", (h,)
        yield b + "ffn_norm.weight", (h,)
        yield b + "ffn_gate.weight", (s.ffn, h)
        yield b + "ffn_up.weight", (s.ffn, h)
        yield b + "ffn_down.weight", (h, s.ffn)
        if s.arch == "gemma3":
            yield b + "post_ffw_norm.weight", (h,)
    yield "output_norm.weight", (h,)
    if not s.tied:
        yield "output.weight", (s.vocab, h)


# -- the tokenizer ---------------------------------------------------------------------------------------------------


class Metadata(BaseModel):
    """GGUF key-value pairs as (value, type, array item type) to write verbatim."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    items: dict[str, tuple[Any, VT, VT | None]]


def tokenizer_from_gguf(path: Path, vocab: int) -> Metadata:
    """Every `tokenizer.*` key of a GGUF, its token list padded to `vocab` entries as llama.cpp's converter pads
    one (`[PAD<id>]`, type UNUSED, score 0), so a model whose embedding has more rows than the tokenizer has
    tokens (Qwen2.5-7B's 152064 against 151665) carries the same list as the real file."""
    reader = gguf.GGUFReader(path)
    items: dict[str, tuple[Any, VT, VT | None]] = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = VT(field.types[0])
        sub = VT(field.types[-1]) if vtype == VT.ARRAY else None
        items[key] = (field.contents(), vtype, sub)
    tokens = items["tokenizer.ggml.tokens"][0]
    if len(tokens) > vocab:
        raise ValueError(f"{path} has {len(tokens)} tokens, more than the model's {vocab} embedding rows")
    pad = range(len(tokens), vocab)
    for key, extra in (
        ("tokenizer.ggml.tokens", [f"[PAD{i}]" for i in pad]),
        ("tokenizer.ggml.token_type", [TOKEN_UNUSED] * len(pad)),
        ("tokenizer.ggml.scores", [0.0] * len(pad)),
    ):
        if key in items and extra:
            value, vtype, sub = items[key]
            items[key] = (list(value) + extra, vtype, sub)
    return Metadata(items=items)


def tiny_tokenizer() -> Metadata:
    """The tiny test checkpoints' byte-level BPE (engine/models/tiny.py: 320 tokens, trained on this project's own
    text) as llama.cpp's "gpt2" tokenizer keys."""
    import json

    from glowplug.engine.models.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tok.all_special_tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    items: dict[str, tuple[Any, VT, VT | None]] = {
        "tokenizer.ggml.model": ("gpt2", VT.STRING, None),
        "tokenizer.ggml.pre": ("gpt2", VT.STRING, None),
        "tokenizer.ggml.tokens": (tokens, VT.ARRAY, VT.STRING),
        "tokenizer.ggml.token_type": (
            [TOKEN_CONTROL if t in special else TOKEN_NORMAL for t in tokens],
            VT.ARRAY,
            VT.INT32,
        ),
        "tokenizer.ggml.merges": (merges, VT.ARRAY, VT.STRING),
        "tokenizer.ggml.bos_token_id": (tok.bos_token_id, VT.UINT32, None),
        "tokenizer.ggml.eos_token_id": (tok.eos_token_id, VT.UINT32, None),
        "tokenizer.ggml.padding_token_id": (tok.pad_token_id, VT.UINT32, None),
        "tokenizer.ggml.add_bos_token": (False, VT.BOOL, None),
        "tokenizer.chat_template": (tok.chat_template, VT.STRING, None),
    }
    return Metadata(items=items)


# -- writing ---------------------------------------------------------------------------------------------------------


def _stored_type(name: str, shape: tuple[int, ...], stored: Stored) -> QT:
    """1-D tensors (norms, biases) stay F32, as llama.cpp's converter and quantizer keep them; Q8_0 needs rows of
    a multiple of 32 values (F16 otherwise)."""
    if len(shape) == 1:
        return QT.F32
    if stored == "Q8_0" and shape[-1] % 32:
        return QT.F16
    return QT[stored]


def _random_tensor(name: str, shape: tuple[int, ...], qtype: QT, rng: np.random.Generator, std: float) -> np.ndarray:
    """The tensor's bytes in `qtype`, made a few rows at a time straight into the output array: weights uniform
    with standard deviation `std` (uniform: 3x cheaper to draw than normal, and the quantizer does not care),
    norms 1 + a tenth of that spread, biases like weights."""
    if len(shape) == 1:
        base = 1.0 if name.endswith("norm.weight") else 0.0
        spread = 0.1 if name.endswith("norm.weight") else std
        return (base + (rng.random(shape, dtype=np.float32) * 2 - 1) * (spread * math.sqrt(3))).astype(np.float32)
    rows, cols = shape
    if qtype == QT.F32:
        out = np.empty(shape, np.float32)
    elif qtype == QT.F16:
        out = np.empty(shape, np.float16)
    else:
        out = np.empty(gguf.quant_shape_to_byte_shape(shape, qtype), np.uint8)
    step = max(1, CHUNK_VALUES // cols)
    a = std * math.sqrt(3)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        chunk = rng.random((r1 - r0, cols), dtype=np.float32)
        chunk *= 2 * a
        chunk -= a
        out[r0:r1] = gguf.quants.quantize(chunk, qtype) if qtype not in (QT.F32, QT.F16) else chunk
    return out


def write_random(
    s: ModelShape, out: Path, tokenizer: Metadata, *, stored: Stored = "F16", seed: int = 0, std: float = 0.02
) -> Path:
    """Write `s` with random weights to `out` as llama.cpp's converter lays a model out (its metadata keys,
    tensor names and order, `general.file_type` of the stored type), one tensor in memory at a time."""
    w = gguf.GGUFWriter(str(out), s.arch)
    w.add_name(s.name)
    w.add_type("model")
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.eps)
    if s.head_dim is not None or s.arch in ("qwen3", "gemma3"):
        w.add_key_length(s.dim)
        w.add_value_length(s.dim)
    if s.sliding_window is not None:
        w.add_sliding_window(s.sliding_window)
    w.add_file_type({"F32": 0, "F16": 1, "Q8_0": 7}[stored])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, (value, vtype, sub) in tokenizer.items.items():
        w.add_key_value(key, value, vtype, sub)
    plan = [(name, shape, _stored_type(name, shape, stored)) for name, shape in tensors(s)]
    for name, shape, qtype in plan:
        nbytes = (
            int(np.prod(gguf.quant_shape_to_byte_shape(shape, qtype)))
            if qtype not in (QT.F32, QT.F16)
            else (int(np.prod(shape)) * (4 if qtype == QT.F32 else 2))
        )
        w.add_tensor_info(
            name,
            shape,
            np.dtype(np.float32 if qtype == QT.F32 else np.float16),
            nbytes,
            raw_dtype=qtype if qtype not in (QT.F32, QT.F16) else None,
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (name, shape, qtype) in enumerate(plan):
        rng = np.random.default_rng([seed, i])
        w.write_tensor_data(_random_tensor(name, shape, qtype, rng, std))
    w.close()
    return out


# -- quantizing with llama.cpp ---------------------------------------------------------------------------------------

FTYPES = (
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K_M",
    "Q4_K_S",
    "Q4_K_M",
    "Q5_K_S",
    "Q5_K_M",
    "Q6_K",
)


def quantize(src: Path, dst: Path, ftype: str = "Q4_K_M", *, threads: int = 2, quiet: bool = False) -> Path:
    """llama.cpp's quantizer (llama-cpp-python's llama_model_quantize) from `src` to `dst` at `ftype`, re-quantizing
    tensors that are already quantized (allow_requantize), so that each tensor gets the type llama.cpp's rules give it
    for that ftype (the mixes of Q4_K_M/Q5_K_M, the Q5_0/Q8_0 fallbacks for rows not a multiple of 256)."""
    if ftype not in FTYPES:
        raise ValueError(f"ftype {ftype!r}: choose one of {', '.join(FTYPES)}")
    import llama_cpp

    if quiet:
        _silence_llama_log(llama_cpp)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {ftype}) failed with status {rc}")
    return dst


_LOG_CALLBACK: Any = None  # kept alive: llama.cpp holds the pointer


def _silence_llama_log(llama_cpp: Any) -> None:
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def synthetic(
    s: ModelShape,
    out: Path,
    tokenizer: Metadata,
    *,
    ftype: str = "Q4_K_M",
    stored: Stored = "F16",
    seed: int = 0,
    std: float = 0.02,
    threads: int = 2,
    quiet: bool = False,
) -> Path:
    """`s` with random weights at `ftype`: written at `stored` into a temporary file beside `out` (deleted after),
    then quantized by llama.cpp."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".synthetic-", dir=out.parent) as tmp:
        base = write_random(s, Path(tmp) / "base.gguf", tokenizer, stored=stored, seed=seed, std=std)
        quantize(base, out, ftype, threads=threads, quiet=quiet)
    return out


# -- inspection ------------------------------------------------------------------------------------------------------


def type_table(path: Path) -> dict[str, str]:
    """{tensor name: type name} of a GGUF, as gguf-dump lists them."""
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def type_summary(path: Path) -> list[tuple[str, str, int]]:
    """(tensor role without the layer index, type, count), e.g. ("attn_v.weight", "Q6_K", 14)."""
    roles = Counter((n.split(".", 2)[2] if n.startswith("blk.") else n, t) for n, t in type_table(path).items())
    return sorted((role, t, c) for (role, t), c in roles.items())


# -- the loader tests' files -----------------------------------------------------------------------------------------


class Fixture(BaseModel):
    """One small file of a layout llama.cpp writes, for the loader tests (tests/test_gguf_layouts.py)."""

    model_config = ConfigDict(frozen=True)

    file: str
    shape: ModelShape
    ftype: str
    why: str


def _tiny(arch: Arch, **kw: Any) -> ModelShape:
    base: dict[str, Any] = dict(
        arch=arch, name=f"tiny {arch}", layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=320, context=2048
    )
    return ModelShape(**{**base, **kw})


FIXTURES: tuple[Fixture, ...] = (
    Fixture(
        file="qwen2-bias-q4_k_m.gguf",
        ftype="Q4_K_M",
        shape=_tiny("qwen2", qkv_bias=True, rope_theta=1e6),
        why="Qwen2.5 as llama.cpp's Q4_K_M writes it: F32 q/k/v biases beside Q4_K q/k and a Q6_K v (layer 0; "
        "Q4_K in layer 1), Q4_K/Q6_K ffn_down, an untied Q6_K head and a Q4_K embedding",
    ),
    Fixture(
        file="qwen2-bias-q5_k_m.gguf",
        ftype="Q5_K_M",
        shape=_tiny("qwen2", qkv_bias=True, rope_theta=1e6),
        why="the same model at Q5_K_M: Q5_K with Q6_K where Q4_K_M has it",
    ),
    Fixture(
        file="qwen2-bias-q6_k.gguf",
        ftype="Q6_K",
        shape=_tiny("qwen2", qkv_bias=True, rope_theta=1e6),
        why="the same model at Q6_K: every matrix Q6_K",
    ),
    Fixture(
        file="qwen2-bias-q8_0.gguf",
        ftype="Q8_0",
        shape=_tiny("qwen2", qkv_bias=True, rope_theta=1e6),
        why="the same model at Q8_0: every matrix Q8_0",
    ),
    Fixture(
        file="qwen2-tied-q5_0-q8_0.gguf",
        ftype="Q4_K_M",
        shape=_tiny("qwen2", hidden=64, ffn=128, heads=4, kv_heads=2, qkv_bias=True, tied=True, rope_theta=1e6),
        why="the tiny checkpoints' Qwen2 shape (hidden 64, FFN 128: rows not a multiple of 256) at Q4_K_M: "
        "llama.cpp falls back to Q5_0 for Q4_K and Q8_0 for Q6_K, as it does for Qwen2.5-0.5B's 896; tied",
    ),
    Fixture(
        file="qwen2-tied-q5_1-q8_0.gguf",
        ftype="Q5_K_M",
        shape=_tiny("qwen2", hidden=64, ffn=128, heads=4, kv_heads=2, qkv_bias=True, tied=True, rope_theta=1e6),
        why="the same small shape at Q5_K_M: Q5_K falls back to Q5_1 (as gemma-3-270m's 640 columns do at "
        "Q5_K_M), Q6_K to Q8_0",
    ),
    Fixture(
        file="llama3-q4_k_m.gguf",
        ftype="Q4_K_M",
        shape=_tiny("llama", rope_theta=500000.0, eps=1e-5),
        why="Llama 3 (8B's layout: GQA, untied, RoPE base 500000) whose q/k rows llama.cpp's converter permutes",
    ),
    Fixture(
        file="qwen3-q4_k_m.gguf",
        ftype="Q4_K_M",
        shape=_tiny("qwen3", heads=2, kv_heads=1, head_dim=128, rope_theta=1e6),
        why="Qwen3: per-head q/k RMSNorms, no biases, heads of 128 (every Qwen3's; transformers' GGUF reader "
        "assumes it)",
    ),
    Fixture(
        file="gemma3-q4_k_m.gguf",
        ftype="Q4_K_M",
        shape=_tiny(
            "gemma3",
            hidden=384,
            heads=2,
            kv_heads=1,
            head_dim=256,
            ffn=512,
            tied=True,
            sliding_window=8,
            rope_theta=1e6,
        ),
        why="Gemma 3 as gemma-3-270m's file has it: four norms per layer stored as 1 + w, q/k norms, heads of "
        "256, a hidden size not a multiple of 256 (Q5_0 q/k/v/gate/up, Q5_0/Q8_0 v, a Q8_0 tied "
        "embedding) beside Q4_K/Q6_K attn_output and ffn_down, sliding layers of 8 keys",
    ),
)

# The fixtures' weights: wide enough that logits are far from uniform and greedy tokens mean something.
FIXTURE_STD = 0.1


def make_fixtures(dest: Path, *, quiet: bool = True) -> list[Path]:
    """Write every FIXTURES file into `dest` (random weights, seed 0, F32 source, then llama.cpp's quantizer)."""
    tok = tiny_tokenizer()
    made = []
    for f in FIXTURES:
        made.append(synthetic(f.shape, dest / f.file, tok, ftype=f.ftype, stored="F32", std=FIXTURE_STD, quiet=quiet))
    return made


# -- the command line ------------------------------------------------------------------------------------------------


def _print_summary(path: Path) -> None:
    size = path.stat().st_size
    print(f"{path}: {size:,} bytes ({size / 1e9:.2f} GB)")
    for role, t, n in type_summary(path):
        print(f"  {role:32} {t:6} x{n}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("random", help="A preset model's exact tensors with random weights, quantized by llama.cpp.")
    r.add_argument("preset", choices=list(PRESETS))
    r.add_argument("out", type=Path)
    r.add_argument(
        "--tokenizer-from",
        type=Path,
        required=True,
        help="A GGUF whose tokenizer.* keys to copy (padded to the preset's vocabulary); for qwen2.5-7b, "
        "the Qwen2.5-Coder-1.5B file (`glowplug models fetch qwen2.5-coder-1.5b`).",
    )
    r.add_argument("--ftype", default="Q4_K_M", choices=FTYPES)
    r.add_argument(
        "--stored",
        default="F16",
        choices=["F32", "F16", "Q8_0"],
        help="Type the random weights are written in before llama.cpp quantizes them.",
    )
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=2)
    q = sub.add_parser("requantize", help="A GGUF re-quantized by llama.cpp at another ftype.")
    q.add_argument("src", type=Path)
    q.add_argument("out", type=Path)
    q.add_argument("--ftype", required=True, choices=FTYPES)
    q.add_argument("--threads", type=int, default=2)
    f = sub.add_parser("fixtures", help="The loader tests' small files (tests/data/gguf).")
    f.add_argument("dest", type=Path)
    i = sub.add_parser("inspect", help="Each tensor role's type and count.")
    i.add_argument("file", type=Path)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.cmd == "random":
        s = PRESETS[args.preset]
        synthetic(
            s,
            args.out,
            tokenizer_from_gguf(args.tokenizer_from, s.vocab),
            ftype=args.ftype,
            stored=args.stored,
            seed=args.seed,
            threads=args.threads,
        )
        _print_summary(args.out)
    elif args.cmd == "requantize":
        quantize(args.src, args.out, args.ftype, threads=args.threads)
        _print_summary(args.out)
    elif args.cmd == "fixtures":
        args.dest.mkdir(parents=True, exist_ok=True)
        for path in make_fixtures(args.dest):
            _print_summary(path)
    else:
        _print_summary(args.file)
    print(f"done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
