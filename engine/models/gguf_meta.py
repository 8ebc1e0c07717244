"""A GGUF's metadata as the files of a Hugging Face folder: config.json, tokenizer.json, tokenizer_config.json.

Built once when the model is prepared (the model cache entry holds them), with the `tokenizers` library directly,
so neither preparing nor serving imports transformers. What is built follows transformers' GGUF loader (the
oracle the tests compare with, which builds the same tokenizer.json for both kinds): a byte-level BPE for
`tokenizer.ggml.model == "gpt2"`; for a Gemma 3 file's SentencePiece vocabulary ("llama": tokens, scores and types,
no merges) a BPE with byte fallback whose merges are derived from the vocabulary (`sentencepiece_merges`); control
tokens added as special tokens, user-defined ones as plain added tokens, BOS prepended when `add_bos_token` says so
(a SentencePiece file without the flag gets it, as llama.cpp does).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from .arch import GEMMA3_ROPE_LOCAL_THETA, GEMMA3_SLIDING_WINDOW_PATTERN, ModelError
from .gguf_header import GGUFContents, read_gguf_metadata

# GGUF architecture -> model_type; Mistral files say "llama". A gemma3 GGUF holds the text model only, which
# transformers calls gemma3_text.
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
_CONTROL, _USER_DEFINED = 3, 4


def open_reader(path: Path) -> GGUFContents:
    """The file's metadata and tensor table, read in one pass (gguf_header.GGUFContents: the `fields` and
    `tensors` of a `gguf.GGUFReader`, about 20x faster on a 262k-token vocabulary); raises ModelError when the file
    is not a readable GGUF."""
    return GGUFContents(path)


def metadata(reader: Any, *keys: str) -> dict[str, Any]:
    """The named fields that exist in the file, as Python values."""
    return {k: reader.fields[k].contents() for k in keys if k in reader.fields}


def _unsupported_architecture(path: Path, arch: object) -> ModelError:
    return ModelError(
        f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(_MODEL_TYPES)}. "
        f"Use a GGUF of one of those families or a Hugging Face folder."
    )


def check_architecture(path: Path) -> str:
    """The model_type of the file's `general.architecture`, read from the header alone (well under a millisecond
    when the key comes first, as llama.cpp writes it), so an architecture glowplug does not run is refused before
    the vocabulary is parsed or any tensor is looked at; raises ModelError naming it and the supported list."""
    arch = read_gguf_metadata(path, stop_at="general.architecture").get("general.architecture")
    model_type = _MODEL_TYPES.get(str(arch))
    if model_type is None:
        raise _unsupported_architecture(path, arch)
    return model_type


def build_config(reader: Any, path: Path, tied: bool) -> dict[str, Any]:
    """config.json for the file's architecture (`tied`: the file has no separate output.weight)."""
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    model_type = _MODEL_TYPES.get(str(arch))
    if model_type is None:
        raise _unsupported_architecture(path, arch)
    p = f"{arch}."
    m = metadata(
        reader,
        *(
            p + k
            for k in (
                "block_count",
                "context_length",
                "embedding_length",
                "feed_forward_length",
                "attention.head_count",
                "attention.head_count_kv",
                "rope.freq_base",
                "attention.layer_norm_rms_epsilon",
                "vocab_size",
                "attention.key_length",
                "rope.scaling.type",
                "rope.scaling.factor",
                "attention.sliding_window",
            )
        ),
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
    )
    try:
        heads = int(m[p + "attention.head_count"])
        hidden = int(m[p + "embedding_length"])
        cfg: dict[str, Any] = {
            "architectures": [_ARCHITECTURES.get(model_type, f"{model_type.title()}ForCausalLM")],
            "model_type": model_type,
            "num_hidden_layers": int(m[p + "block_count"]),
            "hidden_size": hidden,
            "intermediate_size": int(m[p + "feed_forward_length"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(m.get(p + "attention.head_count_kv", heads)),
            "head_dim": int(m.get(p + "attention.key_length", hidden // heads)),
            "max_position_embeddings": int(m.get(p + "context_length", 2048)),
            "rms_norm_eps": float(m.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(m.get(p + "rope.freq_base", 10000.0)),
            "vocab_size": int(m.get(p + "vocab_size") or len(m["tokenizer.ggml.tokens"])),
            "tie_word_embeddings": tied,
            "bos_token_id": m.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": m.get("tokenizer.ggml.eos_token_id"),
        }
    except KeyError as exc:
        raise ModelError(f"{path}: GGUF metadata lacks {exc.args[0]!r}; the file is incomplete, re-export it") from exc
    if m.get(p + "rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(m[p + "rope.scaling.factor"])}
    if model_type == "gemma3_text":
        cfg.update(_gemma3_config(m, p, cfg))
    return cfg


def _gemma3_config(m: dict[str, Any], p: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """What a Gemma 3 config.json holds that its GGUF does not: llama.cpp writes the sliding window and the global
    RoPE base only, and hard-codes the rest in its gemma3 model, as transformers' Gemma3TextConfig defaults do."""
    layers = int(cfg["num_hidden_layers"])
    heads, head_dim = int(cfg["num_attention_heads"]), int(cfg["head_dim"])
    # llama.cpp scales queries by head_dim ** -0.5 except for the 27B model (62 layers), which uses
    # (hidden / heads) ** -0.5; query_pre_attn_scalar carries that (256 = head_dim for gemma-3-270m).
    scalar = cfg["hidden_size"] // heads if layers == 62 else head_dim
    return {
        "sliding_window": int(m.get(p + "attention.sliding_window", 4096)),
        # Every 6th layer attends to everything, the others to the window (llama.cpp's and transformers' pattern).
        "layer_types": [
            "sliding_attention" if (i + 1) % GEMMA3_SLIDING_WINDOW_PATTERN else "full_attention" for i in range(layers)
        ],
        "rope_local_base_freq": GEMMA3_ROPE_LOCAL_THETA,
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    from tokenizers import pre_tokenizers

    # ByteLevel's alphabet is the 256 characters bytes are spelled with; its order is the GPT-2 byte map's.
    chars = pre_tokenizers.ByteLevel.alphabet()
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    assert set(spelled.values()) == set(chars), "tokenizers' byte alphabet is not the GPT-2 byte map"
    return spelled


def _spell(token: str, alphabet: set[str], spelled: dict[int, str]) -> str:
    """A vocabulary entry in the byte alphabet (files store most already so; others are respelled from UTF-8)."""
    return token if set(token) <= alphabet else "".join(spelled[b] for b in token.encode("utf-8"))


def sentencepiece_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges for a SentencePiece vocabulary that stores none (Gemma's), as transformers' GGUF converter derives
    them (tokenization_utils_base.generate_merges with the file order as the score): every split of a token into
    two vocabulary entries is a merge, ranked by the token's position in the file (Gemma's scores do not follow its
    merge order; its file order does; a token listed twice counts at its last position), then by the longer left
    part. That ranking is a plain walk: tokens by position, each token's splits from the longest left part down,
    with no sort of the half-million merges (which took most of a second)."""
    vocab = {t: i for i, t in enumerate(tokens)}  # a later duplicate wins, as in the converter's dict
    merges: list[tuple[str, str]] = []
    append = merges.append
    for token in sorted(vocab, key=vocab.__getitem__):
        for k in range(len(token) - 1, 0, -1):
            left = token[:k]
            if left in vocab:
                right = token[k:]
                if right in vocab:
                    append((left, right))
    return merges


def _gemma_model(tokens: list[str]) -> tuple[Any, list[str]]:
    """(tokenizer, vocabulary as spelled in it) for a Gemma SentencePiece vocabulary, as transformers'
    GemmaTokenizer builds it from a GGUF: BPE with byte fallback over merges derived from the vocabulary, spaces
    normalised to U+2581 and split off after each word, and a token of only spaces (the file writes real spaces
    there) respelled in U+2581 so the merges built from it match."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=sentencepiece_merges(spelled),
            fuse_unk=True,
            unk_token="<unk>",
            dropout=None,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, spelled


def _byte_level_model(tokens: list[str], merges: list[str]) -> tuple[Any, list[str]]:
    """(tokenizer, vocabulary as spelled in it) for a byte-level BPE ("gpt2") vocabulary: entries respelled in
    the byte alphabet where the file did not, ByteLevel pre-tokenizer and decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_map = _byte_alphabet()
    alphabet = set(byte_map.values())
    spelled = [_spell(t, alphabet, byte_map) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    pairs = [tuple(x.split(" ", 1)) for x in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=None, fuse_unk=False, byte_fallback=False))  # type: ignore[arg-type]
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok, spelled


def build_tokenizer(reader: Any, path: Path) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json dict) from the file's `tokenizer.*` fields: a byte-level BPE for
    `tokenizer.ggml.model == "gpt2"`, and for a Gemma 3 file's SentencePiece vocabulary ("llama", with scores and
    no merges) the BPE transformers' GGUF converter builds for it."""
    from tokenizers import AddedToken, processors

    m = metadata(
        reader,
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.chat_template",
        "general.architecture",
    )
    kind = m.get("tokenizer.ggml.model")
    arch = m.get("general.architecture")
    tokens: list[str] = list(m["tokenizer.ggml.tokens"])
    if kind == "gpt2" and "tokenizer.ggml.merges" in m:
        tok, spelled = _byte_level_model(tokens, list(m["tokenizer.ggml.merges"]))
        alphabet: set[str] | None = set(_byte_alphabet().values())
    elif kind == "llama" and arch == "gemma3":
        tok, spelled = _gemma_model(tokens)
        alphabet = None
    else:
        raise ModelError(
            f"{path}: GGUF tokenizer {kind!r} of architecture {arch!r} is not supported (glowplug builds byte-level "
            f"BPE, 'gpt2', with merges, and Gemma 3's SentencePiece vocabulary). Use a Hugging Face folder with its "
            f"tokenizer.json for this model."
        )
    vocab = {t: i for i, t in enumerate(spelled)}
    types = list(m.get("tokenizer.ggml.token_type") or [])
    # A control token outside the byte alphabet is a mislabel in the file; adding it would grow the vocabulary.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types)
        if ty == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    tok.add_tokens([u for u in user if u.content in vocab])

    def named(key: str) -> str | None:
        i = m.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    # A SentencePiece file without the flag gets BOS, as llama.cpp (and transformers' GGUF loader) add it there.
    add_bos = bool(m.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    bos = named("bos_token_id")
    if add_bos and bos is not None:
        bos_id = vocab[spelled[int(m["tokenizer.ggml.bos_token_id"])]]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    config: dict[str, Any] = {
        "bos_token": bos,
        "eos_token": named("eos_token_id"),
        "unk_token": named("unknown_token_id"),
        "pad_token": named("padding_token_id"),
        "add_bos_token": add_bos,
        "chat_template": m.get("tokenizer.chat_template"),
    }
    return tok.to_str(), config
