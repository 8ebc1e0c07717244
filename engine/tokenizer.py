"""The tokenizer: tokenizer.json through the `tokenizers` library, the chat template through jinja2.

transformers is not imported on this path (its import alone costs ~1.5 s of a start); the folder's
tokenizer_config.json supplies the special tokens and, with chat_template.jinja, the chat template. Tests keep
transformers' AutoTokenizer as the oracle for ids, decoding and template rendering.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chat_template import ChatTemplate
from .models.arch import ModelArch, ModelError, model_file

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# A long prompt is tokenized in pieces of about this many characters: each piece is one call into the Rust
# tokenizer (with the GIL released), so a prompt that turns out too long stops after the piece that crossed the
# limit instead of after all of it, and what a piece costs is bounded (~5 ms for 16 K characters of English).
PIECE_CHARS = 16_384
# Where a piece may end: just before a space that follows a printable non-space ASCII character. For the
# pre-tokenizers `_split_exact` accepts, such a space always starts a new pre-token (no alternative of their
# regexes runs from a non-space character into a following space), so the pieces' ids, concatenated, are the
# ids of the whole text. Printable ASCII keeps the test independent of what each regex engine calls whitespace.
_SPLIT_POINT = re.compile(r"[!-~](?= )")
# Pre-tokenizer regexes known to keep that property besides ByteLevel's own (GPT-2's): Llama 3's and Qwen2's.
_SAFE_SPLIT_PATTERNS = frozenset(
    {
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
        r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
        r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)
# Normalizers that never make a text shorter (the characters-per-token bound counts the input's characters) and
# work character by character (a split point stays a split point).
_GROWING_NORMALIZERS = frozenset({"Lowercase", "NFD", "NFKD"})
_SPLIT_SAFE_NORMALIZERS = _GROWING_NORMALIZERS | {"NFC", "NFKC"}
# Pre-tokenizers that drop no character: every input character ends up inside some token.
_COVERING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Metaspace", "Punctuation"})
_POST_PROCESSORS = frozenset({"ByteLevel", "TemplateProcessing", "RobertaProcessing", "BertProcessing"})


class PromptTooLong(ValueError):
    """A prompt with more tokens than the caller's limit, found before (or while) tokenizing all of it.

    `at_least` is a proven lower bound on its token count; `basis` says where it comes from: the length in
    characters (no token of this tokenizer covers more than so many of them), or the tokens of the pieces
    counted before tokenizing stopped."""

    def __init__(self, at_least: int, limit: int, chars: int, basis: str) -> None:
        super().__init__(f"the prompt has at least {at_least:,} tokens ({basis}), more than the {limit:,} allowed")
        self.at_least = at_least
        self.limit = limit
        self.chars = chars
        self.basis = basis


@dataclass(frozen=True)
class TokenizerShape:
    """What bounded tokenization may assume about a tokenizer, read from its tokenizer.json once.

    max_token_chars: the most input characters one token can cover (longest vocabulary entry or added token), or
        None where some input can end up in no token or one token can cover unboundedly many characters
        (normalizers that shrink text, pre-tokenizers that drop whitespace, WordPiece's [UNK] for a long word).
    split_exact: tokenizing pieces cut at `_SPLIT_POINT` and concatenating the ids gives the ids of the whole.
    """

    max_token_chars: int | None
    split_exact: bool


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

    @functools.cached_property
    def shape(self) -> TokenizerShape:
        """Computed on first use, or adopted (`adopt_shape`). Racing first calls compute the same value twice,
        harmlessly."""
        spec = _shape_spec(self.backend)
        tokens = [self.backend.id_to_token(i) for i in range(len(self))]
        if None in tokens:  # ids with holes: some tokens sit past len(self)
            tokens = list(self.backend.get_vocab(with_added_tokens=True))
        longest = max((len(t) for t in tokens), default=1)
        return TokenizerShape(
            max_token_chars=max(1, longest) if _chars_bound_holds(spec) else None,
            split_exact=_split_exact(spec),
        )

    def adopt_shape(self, shape: TokenizerShape) -> None:
        """Take the shape another process computed from the same tokenizer files: the server's copy then never
        computes it on a request (up to ~1 s holding the GIL on a 150 K vocabulary)."""
        self.__dict__["shape"] = shape

    def _encode_nogil(self, texts: list[str]) -> list[Any]:
        # The batch calls release the GIL while Rust works (`encode` holds it throughout: a 2 MB prompt held a
        # 10 ms timer on another thread back by 1.9 s); the fast variant skips computing offsets we never read.
        batch = getattr(self.backend, "encode_batch_fast", None) or self.backend.encode_batch
        return list(batch(texts, add_special_tokens=False))

    def encode_bounded(self, text: str, *, limit: int, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text` as `encode` gives them, or PromptTooLong as soon as they are known to exceed `limit`.

        First, without tokenizing: the character count bounds the token count from below. Then the text is
        tokenized in pieces of about PIECE_CHARS characters (where `shape.split_exact` says pieces give the same ids
        as the whole; else in one call), each call releasing the GIL, stopping once the count passes `limit`.
        """
        shape = self.shape
        specials = self.backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        if shape.max_token_chars is not None:
            at_least = math.ceil(len(text) / shape.max_token_chars) + specials
            if at_least > limit:
                basis = (
                    f"it is {len(text):,} characters and no token of this tokenizer covers more than "
                    f"{shape.max_token_chars}"
                )
                raise PromptTooLong(at_least, limit, len(text), basis)
        pieces = _pieces(text) if shape.split_exact else [text]
        encodings: list[Any] = []
        count = specials
        done = 0
        for piece in pieces:
            encoding = self._encode_nogil([piece])[0]
            encodings.append(encoding)
            count += len(encoding.ids)
            done += len(piece)
            if count > limit:
                basis = f"counted in its first {done:,} of {len(text):,} characters"
                raise PromptTooLong(count, limit, len(text), basis)
        if specials == 0 or self.backend.post_processor is None:
            return [i for e in encodings for i in e.ids]
        from tokenizers import Encoding

        merged = Encoding.merge(encodings, growing_offsets=True) if len(encodings) != 1 else encodings[0]
        return list(self.backend.post_process(merged, None, True).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        # transformers ignores clean_up_tokenization_spaces for BPE tokenizers; so does this.
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @property
    def decode_list(self) -> Callable[[list[int], bool], str]:
        """`decode` for a list, called as decode_list(ids, skip_special_tokens): the backend's own method, with no
        Python frame or copy in between (the detokenizer calls it for every generated token; positional
        arguments, since keywords cost the backend as much again as the call)."""
        return self.backend.decode  # type: ignore[no-any-return]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> Any:
        if not self.chat_template:
            raise ModelError("this model's tokenizer has no chat template; send a plain prompt instead")
        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        specials = {k: v for k, v in self.special_tokens.items() if v is not None}
        tools = kwargs.pop("tools", None)
        text = self._template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens={**specials, **kwargs},
            tools=tools,
            documents=None,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _pieces(text: str) -> list[str]:
    """`text` cut into pieces of at least PIECE_CHARS characters at `_SPLIT_POINT`s (the last may be shorter;
    a text with no split point stays whole)."""
    pieces = []
    start = 0
    while len(text) - start > PIECE_CHARS:
        found = _SPLIT_POINT.search(text, start + PIECE_CHARS - 1)
        if found is None:
            break
        end = found.end()
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces


def _shape_spec(backend: Any) -> dict[str, Any]:
    """The parts of tokenizer.json that TokenizerShape reads, from the backend's components: the whole file's JSON
    (vocabulary and merges) is not built, which took 0.7 s for a 150 K vocabulary against 0.2 s this way."""

    def part(component: Any) -> dict[str, Any] | None:
        return None if component is None else json.loads(component.__getstate__())

    model = backend.model
    added = backend.get_added_tokens_decoder().values()
    return {
        "model": {"type": type(model).__name__}
        | {k: getattr(model, k, None) for k in ("dropout", "fuse_unk", "unk_token", "byte_fallback")},
        "normalizer": part(backend.normalizer),
        "pre_tokenizer": part(backend.pre_tokenizer),
        "post_processor": part(backend.post_processor),
        "truncation": backend.truncation,
        "padding": backend.padding,
        "added_tokens": [
            {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip, "single_word": t.single_word} for t in added
        ],
    }


def _parts(component: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A tokenizer.json component as a flat list (a Sequence's members, else itself); [] for null."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [p for member in component.get(key, []) for p in _parts(member, key)]
    return [component]


def _chars_bound_holds(spec: dict[str, Any]) -> bool:
    """Whether every input character lands in some token, and no token stands for more characters than its
    vocabulary entry has (so tokens >= characters / longest entry)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return False  # WordPiece turns a long word into one [UNK]; Unigram and WordLevel similar
    if model.get("fuse_unk") and model.get("unk_token") is not None and not model.get("byte_fallback"):
        return False  # a run of unknown characters becomes one token
    if any(n.get("type") not in _GROWING_NORMALIZERS for n in _parts(spec.get("normalizer"), "normalizers")):
        return False
    for pre in _parts(spec.get("pre_tokenizer"), "pretokenizers"):
        if pre.get("type") not in _COVERING_PRE_TOKENIZERS or pre.get("behavior") == "Removed":
            return False
    return True


def _split_exact(spec: dict[str, Any]) -> bool:
    """Whether pieces cut at `_SPLIT_POINT` tokenize to the same ids as the whole text (see PIECE_CHARS)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return False
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return False
    if any(n.get("type") not in _SPLIT_SAFE_NORMALIZERS for n in _parts(spec.get("normalizer"), "normalizers")):
        return False
    post = spec.get("post_processor")
    if post is not None and any(p.get("type") not in _POST_PROCESSORS for p in _parts(post, "processors")):
        return False
    for token in spec.get("added_tokens") or []:
        # An added token is matched before pre-tokenization: one holding a space could span a split point, and
        # one that strips or needs whitespace around it looks across it.
        if " " in token.get("content", "") or token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return False
    pres = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    regexes = 0
    for pre in pres:
        kind = pre.get("type")
        if kind == "ByteLevel":
            regexes += bool(pre.get("use_regex", True))
        elif kind == "Split":
            pattern = pre.get("pattern") or {}
            if (
                pattern.get("Regex") not in _SAFE_SPLIT_PATTERNS
                or pre.get("invert")
                or pre.get("behavior") != "Isolated"
            ):
                return False
            regexes += 1
        elif kind == "Digits":
            continue  # splits digits from everything else: never across a space
        else:
            return False
    # Without a splitting regex, BPE would run over the whole text as one word, and merges could cross a space.
    return regexes >= 1


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

    path = model_file(
        model_dir,
        "tokenizer.json",
        "glowplug reads the fast-tokenizer file; save the tokenizer with transformers' save_pretrained() (it writes "
        "tokenizer.json) or copy it from the original checkpoint.",
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


def template_takes_tools(tokenizer: Any) -> bool:
    """Does the chat template render a `tools` list (Qwen2.5's, Llama 3's do)?"""
    source = getattr(tokenizer, "chat_template", None)
    return isinstance(source, str) and "tools" in source


def encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    limit: int | None = None,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
) -> list[int]:
    """The ids of the rendered conversation (with `tools` for templates that take them; ending with the assistant
    turn's opening unless `add_generation_prompt` is false); with `limit`, tokenized as `encode_bounded` does. The
    template writes its own special tokens: `add_special_tokens` adds the tokenizer's too (/tokenize's option)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("this model's tokenizer has no chat template; send a plain prompt instead of chat messages")
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    # The template already carries any BOS token; don't let the tokenizer add a second one.
    if limit is not None:
        return encode_bounded(tokenizer, text, limit=limit, add_special_tokens=add_special_tokens)
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def tokenizer_shape(tokenizer: Any) -> TokenizerShape | None:
    """A glowplug Tokenizer's shape (computed if need be); None for any other tokenizer object."""
    return tokenizer.shape if isinstance(tokenizer, Tokenizer) else None


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token of `tokenizer` can cover, where that bounds token counts (see TokenizerShape);
    None for tokenizers other than ours."""
    return tokenizer.shape.max_token_chars if isinstance(tokenizer, Tokenizer) else None


def encode_bounded(tokenizer: Any, text: str, *, limit: int, add_special_tokens: bool = True) -> list[int]:
    """`Tokenizer.encode_bounded` for our tokenizer; any other (a transformers tokenizer in tests) is called on the
    whole text and its count checked after."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode_bounded(text, limit=limit, add_special_tokens=add_special_tokens)
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    if len(ids) > limit:
        raise PromptTooLong(len(ids), limit, len(text), "all of it tokenized")
    return ids
