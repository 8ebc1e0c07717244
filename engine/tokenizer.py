"""The tokenizer comes from transformers, loaded from the local model folder only (no hub access)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .models.arch import ModelArch, ModelError


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"{model_dir}: cannot load a tokenizer ({exc}). The folder needs tokenizer.json (or the "
            f"tokenizer files of its family) next to config.json; copy them from the original checkpoint."
        ) from exc


def eos_token_ids(tokenizer: Any, arch: ModelArch, model_dir: Path) -> frozenset[int]:
    ids = set(arch.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


def encode_prompt(tokenizer: Any, prompt: str, *, chat: bool) -> list[int]:
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt)["input_ids"])


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("this model's tokenizer has no chat template; send a plain prompt instead of chat messages")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template already carries any BOS token; don't let the tokenizer add a second one.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
