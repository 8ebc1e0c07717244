"""Fill in the middle: a vocabulary's FIM tokens (`fim_tokens`) and the prefix-suffix-middle prompt made with them
(`encode_fim`), for `suffix` on completions (lifecycle/openai_api.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .tokenizer import Tokenizer, encode_bounded

# Fill-in-the-middle token families, as the models' vocabularies spell them: (prefix, suffix, middle) and the tokens
# that end a middle (besides EOS). Qwen2.5-Coder's; StarCoder's and its descendants' (also DeepSeek-Coder-V2 Lite's
# base uses them). llama.cpp finds the same names when a GGUF does not give the ids.
_FIM_FAMILIES = (
    (
        ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
        (
            "<|fim_pad|>",
            "<|file_sep|>",
            "<|repo_name|>",
            "<|endoftext|>",
            "<|fim_prefix|>",
            "<|fim_suffix|>",
            "<|fim_middle|>",
        ),
    ),
    (
        ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
        ("<fim_pad>", "<file_sep>", "<reponame>", "<|endoftext|>", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ),
)


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's fill-in-the-middle tokens: the three markers of a prefix-suffix-middle (PSM) prompt, and the
    ids that end the middle (a model trained for FIM writes one of them, or EOS, when the gap is filled)."""

    prefix: int
    suffix: int
    middle: int
    end_ids: tuple[int, ...]
    names: tuple[str, str, str]


def _vocab_id(tokenizer: Any, text: str) -> int | None:
    if isinstance(tokenizer, Tokenizer):
        found = tokenizer.backend.token_to_id(text)
    else:
        found = tokenizer.get_vocab().get(text)
    return None if found is None else int(found)


def fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The FIM tokens of `tokenizer`'s vocabulary (the first family whose three markers are all there), or None
    when it has none (the model was not trained to fill in the middle)."""
    for names, ends in _FIM_FAMILIES:
        ids = [_vocab_id(tokenizer, n) for n in names]
        if all(i is not None for i in ids):
            end_ids = tuple(dict.fromkeys(i for i in (_vocab_id(tokenizer, e) for e in ends) if i is not None))
            return FimTokens(ids[0], ids[1], ids[2], end_ids, names)  # type: ignore[arg-type]
    return None


def encode_fim(tokenizer: Any, fim: FimTokens, prefix: str | list[int], suffix: str, *, limit: int) -> list[int]:
    """The prefix-suffix-middle prompt `<prefix>PREFIX<suffix>SUFFIX<middle>` (what Qwen2.5-Coder and StarCoder were
    trained on; the model writes the middle next), behind a BOS where the tokenizer adds one. `prefix` is text or
    ids; the texts are tokenized without special tokens, as encode_bounded does (PromptTooLong past `limit`)."""
    head = encode_bounded(tokenizer, "", limit=limit)
    pre = (
        list(prefix)
        if isinstance(prefix, list)
        else encode_bounded(tokenizer, prefix, limit=limit, add_special_tokens=False)
    )
    suf = encode_bounded(tokenizer, suffix, limit=limit, add_special_tokens=False)
    return [*head, fim.prefix, *pre, fim.suffix, *suf, fim.middle]
