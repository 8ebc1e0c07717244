"""The tokenizer: tokenizer.json through the `tokenizers` library, the chat template through jinja2.

transformers is not imported on this path (its import alone costs ~1.5 s of a start); the folder's
tokenizer_config.json supplies the special tokens and, with chat_template.jinja, the chat template. Tests keep
transformers' AutoTokenizer as the oracle for ids, decoding and template rendering.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .chat_template import ChatTemplate
from .models.arch import ModelArch, ModelError

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """The slice of a transformers tokenizer the engine uses: call, decode, len, special ids, chat template."""

    def __init__(self, backend: Any, config: dict[str, Any], chat_template: str | None) -> None:
        self.backend = backend
        self.special_tokens = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        self.chat_template = chat_template
        self._template: ChatTemplate | None = None

    def __len__(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def _id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self.backend.token_to_id(text)

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens["eos_token"]

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens["bos_token"]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, *, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        # transformers ignores clean_up_tokenization_spaces for BPE tokenizers; so does this.
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @property
    def decode_list(self) -> Callable[[list[int], bool], str]:
        """`decode` for a list, called as decode_list(ids, skip_special_tokens): the backend's own method, with no
        Python frame or copy in between (the detokenizer calls it for every generated token; positional
        arguments, since keywords cost the backend as much again as the call)."""
        return self.backend.decode  # type: ignore[no-any-return]

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tokenize: bool = False,
                            add_generation_prompt: bool = True, **kwargs: Any) -> Any:
        if not self.chat_template:
            raise ModelError("this model's tokenizer has no chat template; send a plain prompt instead")
        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        specials = {k: v for k, v in self.special_tokens.items() if v is not None}
        text = self._template.render(messages, add_generation_prompt=add_generation_prompt,
                                     special_tokens={**specials, **kwargs}, tools=None, documents=None)  # fmt: skip
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja (what transformers >= 4.43 saves), else tokenizer_config.json's chat_template (a string,
    or a list of named templates of which "default" is used)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    found = config.get("chat_template")
    if isinstance(found, list):
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    return found if isinstance(found, str) else None


def load_tokenizer(model_dir: Path) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelError(
            f"{path}: tokenizer.json is missing. glowplug reads the fast-tokenizer file; save the tokenizer with "
            f"transformers' save_pretrained() (it writes tokenizer.json) or copy it from the original checkpoint."
        )
    try:
        backend = Backend.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
        raise ModelError(f"{path}: cannot load the tokenizer ({exc}); re-save it or copy it again") from exc
    cfg_path = model_dir / "tokenizer_config.json"
    try:
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise ModelError(f"{cfg_path}: not valid JSON ({exc}); re-save the tokenizer") from exc
    return Tokenizer(backend, config, _chat_template(model_dir, config))


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
