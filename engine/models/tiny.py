"""Tiny random checkpoints in Hugging Face format, made with transformers' own classes (tests and benchmarks).

The tokenizer is a small byte-level BPE trained on text this project wrote, so nothing is downloaded.
transformers is not a runtime dependency: it comes with the `test` extra, and is imported only when one is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glowplug.base.errors import require_extra

NEEDS = "making the tiny test checkpoints (glowplug.engine.models.tiny)"

TINY_VARIANTS = ("llama", "llama3-rope", "linear-rope", "mistral", "qwen2", "qwen3", "gemma3")

_CORPUS = [
    "glowplug starts an inference server and accounts for every second of its start-up.",
    "The scheduler mixes prefill chunks and decode steps in one continuous batch.",
    "Each key and value block holds sixteen tokens; full blocks are shared by prefix hash.",
    "Quantized weights read fewer bytes per token, so decoding runs faster on a memory-bound machine.",
    "A request may stop at a stop string, at the end-of-sequence token, or at max_tokens.",
    "Ünïcödé text, emoji like 🚀🔥 and CJK characters 你好世界 exercise multi-byte UTF-8 decoding.",
    "The quick brown fox jumps over the lazy dog while the compiler caches its graphs.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation: commas, periods; colons!",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(vocab_size: int = 320) -> Any:
    require_extra(("transformers",), NEEDS, "test")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(variant: str, vocab: int, eos: int, bos: int, **overrides: Any) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        eos_token_id=eos,
        bos_token_id=bos,
        pad_token_id=bos,
        tie_word_embeddings=False,
    )
    cls: Any
    extra: dict[str, Any]
    if variant == "llama":
        cls, extra = tf.LlamaConfig, dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif variant == "llama3-rope":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cls, extra = tf.LlamaConfig, dict(rope_parameters=rope, tie_word_embeddings=True)
    elif variant == "linear-rope":
        cls, extra = tf.LlamaConfig, dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    elif variant == "mistral":
        cls, extra = tf.MistralConfig, dict(sliding_window=None, head_dim=16)
    elif variant == "qwen2":
        cls, extra = tf.Qwen2Config, dict(tie_word_embeddings=True)
    elif variant == "qwen3":
        cls, extra = tf.Qwen3Config, dict(head_dim=32)
    elif variant == "gemma3":
        # A window of 8 keys so short prompts already cross it; one sliding and one full layer, each with its own
        # RoPE base; a query scale other than head_dim's.
        cls, extra = (
            tf.Gemma3TextConfig,
            dict(
                head_dim=16,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=24,
                tie_word_embeddings=True,
            ),
        )
    else:
        raise ValueError(f"unknown tiny variant {variant!r}; choose one of {', '.join(TINY_VARIANTS)}")
    return cls(**{**common, **extra, **overrides})


def make_tiny_checkpoint(out_dir: Path, variant: str = "llama", *, seed: int = 0, **overrides: Any) -> Path:
    """Write a random `variant` model + tokenizer to `out_dir` with save_pretrained; returns the folder."""
    require_extra(("transformers",), NEEDS, "test")
    import torch
    from transformers import AutoModelForCausalLM

    tok = make_tiny_tokenizer()
    cfg = _config(variant, len(tok), tok.eos_token_id, tok.bos_token_id, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init is tiny by default; widen it so that logits are far from uniform and greedy tests mean something.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    return out_dir
