"""Constrained decoding: grammars (llguidance) that decide, token by token, which tokens a request may sample next.

A request's grammar travels as llguidance's own grammar text (`SamplingParams.grammar`), built by the helpers here
from a JSON schema, a regex, a list of choices or a Lark grammar, and checked (`check_grammar`) without a
tokenizer, so the API server refuses a bad one with a 400 before the engine sees it. The engine core holds one
`GrammarBackend`: the tokenizer's grammar view (built at start by the `grammar_init` stage, its own row of the phase
table) and a cache of parsed grammars by their text's hash, from which each sequence gets a
matcher of its own (a copy: no parse per request for a repeated schema). The scheduler starts the bitmask of a
step's constrained rows when it plans the step (`fill_bitmask_async`: on the backend's own thread, while the model's
forward runs; llguidance releases the GIL while it computes a mask), the sampler waits for it and applies it
(engine/sampler.py `apply_token_bitmask`), and `update_from_output` feeds the sampled token back (`advance`).

llguidance rather than xgrammar: its import takes ~0.1 s and pulls neither torch nor transformers (xgrammar's
~4.7 s pulls both, which the API server must not import), it has no per-schema compile step, and its per-token
mask costs the same (reports/structured_outputs.md).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

# JSON as the model is asked to write it: one space after ':' and ',' (what chat models write unprompted, so the
# grammar rarely fights the model's first choice), no free whitespace (a small model under free whitespace can
# fill max_tokens with newlines).
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Parsed grammars kept per engine (a new schema costs a parse of a few milliseconds; a repeated one a copy).
_CACHE_SIZE = 256


class GrammarError(ValueError):
    """A grammar llguidance cannot use, with its reason."""


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """The grammar of JSON documents valid against `schema` (GrammarError naming an unsupported or invalid part)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from None


def regex_grammar(regex: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(regex)


def choice_grammar(choices: Sequence[str]) -> str:
    """Exactly one of `choices`, as written."""
    return llguidance.grammar_from("choice", json.dumps(list(choices)))


def lark_grammar(lark: str) -> str:
    """A Lark grammar (llguidance's dialect: `%json{...}` embeds a JSON schema)."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check_grammar(grammar: str) -> None:
    """GrammarError with llguidance's reason when `grammar` cannot be used (a bad regex, a Lark syntax error, a
    schema keyword it does not support); checked without a tokenizer."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error)


def grammar_key(grammar: str) -> str:
    return hashlib.sha256(grammar.encode()).hexdigest()


class GrammarBackend:
    """One engine's grammar machinery: the tokenizer's view for llguidance, parsed grammars by hash, matchers.

    `tokenizer_json`: returns the tokenizer in the `tokenizers` library's JSON (called once, when first needed);
    `vocab_size`: the model's logits width (a bitmask row covers it); `eos_token_ids`: the tokens that may end a
    constrained sequence once its grammar accepts. Not thread-safe, except `prepare` (it may run on any thread)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._parsed: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None  # fill_bitmask_async's thread, started on first use
        self.init_s: float | None = None  # seconds the tokenizer's grammar view took to build
        self.parse_s = 0.0  # seconds spent parsing new grammars, summed
        self.cache_hits = 0

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def prepare(self) -> llguidance.LLTokenizer:
        """The tokenizer's grammar view, built on the first call (the grammar_init stage makes it at start: ~0.5 s
        at a 49k vocabulary, ~1.8 s at 151k, with the GIL held)."""
        with self._lock:
            if self._tokenizer is None:
                t0 = time.perf_counter()
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=self._eos or None
                )
                self.init_s = time.perf_counter() - t0
            return self._tokenizer

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar` (GrammarError when it cannot be used with this tokenizer)."""
        key = grammar_key(grammar)
        parsed = self._parsed.get(key)
        if parsed is not None:
            self._parsed.move_to_end(key)
            self.cache_hits += 1
            return parsed.deep_copy()
        tokenizer = self.prepare()
        t0 = time.perf_counter()
        parsed = llguidance.LLMatcher(tokenizer, grammar)
        self.parse_s += time.perf_counter() - t0
        if parsed.is_error():
            raise GrammarError(parsed.get_error())
        # A grammar whose language is empty passes every check without a tokenizer; its first mask finds it (a
        # copy's, once per new grammar), and the request is refused instead of ending at once with nothing.
        probe = parsed.deep_copy()
        fill_next_token_bitmask(probe, np.empty((1, self.words), dtype=np.int32), 0)
        if probe.is_error():
            raise GrammarError(
                "the grammar matches no output at all (no text satisfies it); fix it so that some text does"
            )
        self._parsed[key] = parsed
        if len(self._parsed) > _CACHE_SIZE:
            self._parsed.popitem(last=False)
        return parsed.deep_copy()

    def fill_bitmask(self, matchers: Sequence[llguidance.LLMatcher]) -> np.ndarray:
        """[len(matchers), words] int32: row j the tokens matchers[j] allows next (bit t % 32 of word t // 32)."""
        mask = np.empty((len(matchers), self.words), dtype=np.int32)
        for j, m in enumerate(matchers):
            fill_next_token_bitmask(m, mask, j)
        return mask

    def fill_bitmask_async(self, matchers: Sequence[llguidance.LLMatcher]) -> Future[np.ndarray]:
        """`fill_bitmask(matchers)` on the backend's own thread. Every matcher's state is final when this is called
        (the previous step's tokens are consumed) and none may be advanced before the result is taken."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glowplug-grammar-mask")
        return self._pool.submit(self.fill_bitmask, list(matchers))


def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Feed the sampled `token` to `matcher`; True when the sequence must end here (its grammar is complete, or the
    token broke it: only a token outside the mask can, which the sampler never draws)."""
    if not matcher.consume_token(token):
        return True
    return bool(matcher.is_stopped())


def tokenizer_json(tokenizer: Any) -> Callable[[], str]:
    """What GrammarBackend reads the tokenizer from: glowplug's Tokenizer (engine/tokenizer.py) or a transformers
    fast tokenizer, both backed by the `tokenizers` library."""

    def read() -> str:
        backend = getattr(tokenizer, "backend", None) or getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise GrammarError(f"{type(tokenizer).__name__} is not backed by the tokenizers library; grammars need it")
        return str(backend.to_str())

    return read
