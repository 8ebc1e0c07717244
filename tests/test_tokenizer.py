"""The light tokenizer (tokenizers + jinja2) on Hugging Face folders, against transformers' AutoTokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glowplug.engine.detokenizer import IncrementalDetokenizer
from glowplug.engine.models.arch import ModelError
from glowplug.engine.tokenizer import encode_chat, load_tokenizer

TEXTS = [
    "glowplug starts an inference server.",
    "Ünïcödé 🚀🔥 你好世界",
    "  two  spaces\n\ttab",
    "<|im_start|>user\nhi<|im_end|>",
    "",
    "Numbers 0 1 2 3 10 100",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "Ünïcödé 🚀"},
    ],
]
# Uses what transformers offers templates: tojson (non-ASCII kept), loop controls, special tokens by name, and
# trim_blocks/lstrip_blocks whitespace handling.
FEATURES = (
    "{{ bos_token }}{% for m in messages %}\n"
    "  {% if m['role'] == 'skip' %}{% continue %}{% endif %}\n"
    "{{ m['role'] }}: {{ m['content'] | tojson }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _hf(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from glowplug.engine.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tok"), "llama")


def test_ids_decode_and_len_match_transformers(tiny: Path) -> None:
    ours, ref = load_tokenizer(tiny), _hf(tiny)
    assert len(ours) == len(ref) and ours.eos_token_id == ref.eos_token_id and ours.bos_token_id == ref.bos_token_id
    for text in TEXTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == ref(text, add_special_tokens=special)["input_ids"], text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_from_jinja_file_matches_transformers(tiny: Path, messages) -> None:
    assert (tiny / "chat_template.jinja").is_file()
    ours, ref = load_tokenizer(tiny), _hf(tiny)
    for gen in (True, False):
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == want
    assert (
        encode_chat(ours, messages)
        == ref(ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
            "input_ids"
        ]
    )


def _with_config_template(tiny: Path, dest: Path, template: str) -> Path:
    """A copy whose chat template lives in tokenizer_config.json only (how older checkpoints ship it)."""
    shutil.copytree(tiny, dest)
    (dest / "chat_template.jinja").unlink()
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize(
    "messages", [*CONVERSATIONS, [{"role": "skip", "content": "x"}, {"role": "user", "content": "y"}]]
)
def test_chat_template_from_tokenizer_config_matches_transformers(tiny: Path, tmp_path: Path, messages) -> None:
    folder = _with_config_template(tiny, tmp_path / "old", FEATURES)
    ours, ref = load_tokenizer(folder), _hf(folder)
    for gen in (True, False):
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == want


def test_raise_exception_is_a_model_error(tiny: Path, tmp_path: Path) -> None:
    folder = _with_config_template(tiny, tmp_path / "strict", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ModelError, match="roles must alternate"):
        load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer_json_names_the_fix(tiny: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny, tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="tokenizer.json is missing.*save_pretrained"):
        load_tokenizer(tmp_path / "m")


def test_incremental_detokenization_is_exact_with_multibyte_and_stop(tiny: Path) -> None:
    tok, ref = load_tokenizer(tiny), _hf(tiny)
    text = "Ünïcödé 🚀🔥 你好世界 and the end STOP here"
    ids = tok(text)["input_ids"]
    detok = IncrementalDetokenizer(tok, [], stop=())
    for i in ids:
        detok.append(i)
    detok.flush()
    assert detok.output_text == ref.decode(ids, skip_special_tokens=True)
    stopped = IncrementalDetokenizer(tok, [], stop=("STOP",))
    streamed = ""
    for i in ids:
        if stopped.append(i):
            break
        streamed += stopped.take_stream_delta(False)
    streamed += stopped.take_stream_delta(True)
    assert stopped.stopped_by == "STOP" and streamed == stopped.output_text == text[: text.index("STOP")]


def test_start_on_a_folder_never_imports_transformers(tiny: Path, tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from glowplug.engine.config import EngineConfig\n"
        "from glowplug.engine.startup import build_engine\n"
        f"r = build_engine(EngineConfig.from_flat(model={str(tiny)!r}, compile='off', max_model_len=128))\n"
        "from glowplug.engine.tokenizer import encode_chat\n"
        "encode_chat(r.engine.tokenizer, [{'role': 'user', 'content': 'hi'}])\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')\n"
        "assert not bad, bad[:5]\n"
    )
    env = {**__import__("os").environ, "GLOWPLUG_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---------------------------------------------------------------- bounded tokenization (the server's prompts)

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
# Texts where piece boundaries could go wrong: runs of spaces, newlines after punctuation, digit groups, multi-byte
# characters, special tokens (also split by a space), contractions.
_PIECES = [
    "ab",
    "cd",
    " ",
    "  ",
    "\n",
    "\r\n",
    "\t",
    "!",
    ".",
    "'s",
    "'ll",
    "123",
    "4567",
    "你好",
    "🚀",
    "é",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_",
    "start|>",
    "\u00a0",
    "\u3000",
    "x y",
    "-",
    "--",
    "$",
]


def _backend(kind: str):  # -> tokenizers.Tokenizer
    from tokenizers import Regex, models, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as Backend

    from glowplug.engine.models.tiny import _CORPUS

    specials = ["<|begin_of_text|>", "<|im_start|>", "<|im_end|>"]
    if kind == "wordpiece":
        tok = Backend(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"], show_progress=False)
    else:
        tok = Backend(models.BPE())
        if kind == "llama3":
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
            tok.post_processor = processors.TemplateProcessing(
                single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
            )
        elif kind == "metaspace":
            tok.normalizer = normalizers.NFKC()
            tok.pre_tokenizer = pre_tokenizers.Metaspace()
        else:
            raise ValueError(kind)
        alphabet = pre_tokenizers.ByteLevel.alphabet() if kind == "llama3" else []
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
        )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def llama3_like():
    from glowplug.engine.tokenizer import Tokenizer

    return Tokenizer(_backend("llama3"), {}, None)


def test_tokenizer_shape_decides_what_bounded_tokenization_may_assume(tiny: Path, llama3_like) -> None:
    from glowplug.engine.tokenizer import Tokenizer

    assert load_tokenizer(tiny).shape.split_exact and load_tokenizer(tiny).shape.max_token_chars is not None
    assert llama3_like.shape.split_exact and llama3_like.shape.max_token_chars is not None
    # Whitespace is dropped before WordPiece, and a long word is one [UNK]: no bound, and no pieces.
    wordpiece = Tokenizer(_backend("wordpiece"), {}, None).shape
    assert wordpiece.max_token_chars is None and not wordpiece.split_exact
    # NFKC can shorten text; Metaspace's pieces are not known to split exactly.
    metaspace = Tokenizer(_backend("metaspace"), {}, None).shape
    assert metaspace.max_token_chars is None and not metaspace.split_exact
    # The spec the shape reads from the components is the whole file's, where the shape looks.
    from glowplug.engine.tokenizer import _shape_spec

    for backend in (load_tokenizer(tiny).backend, llama3_like.backend, _backend("wordpiece"), _backend("metaspace")):
        whole = json.loads(backend.to_str())
        part = _shape_spec(backend)
        assert part["model"] == {k: whole["model"].get(k) for k in part["model"]}
        assert {k: v for k, v in part.items() if k not in ("model", "added_tokens")} == {
            k: whole.get(k) for k in part if k not in ("model", "added_tokens")
        }
        keys = ("content", "lstrip", "rstrip", "single_word")
        assert part["added_tokens"] == [{k: t[k] for k in keys} for t in whole["added_tokens"]]


def test_a_shape_sent_through_the_ready_frame_is_the_one_computed_and_is_not_recomputed(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from glowplug.engine import core_frames as cf
    from glowplug.engine.tokenizer import Tokenizer, max_token_chars, tokenizer_shape

    core_side = load_tokenizer(tiny)
    frame = cf.Ready(1, len(core_side), 64, str(tiny), cf.CoreLoad(*[0] * 9), None, 1, tokenizer_shape(core_side))
    got = cf.decode_frame(cf.encode_frame(frame), cf.Ready)
    expected = core_side.shape
    server_side = load_tokenizer(tiny)
    monkeypatch.setattr(Tokenizer, "shape", property(lambda _self: pytest.fail("the server recomputed the shape")))
    server_side.adopt_shape(got.tokenizer_shape)
    assert server_side.__dict__["shape"] == expected
    monkeypatch.undo()
    assert max_token_chars(server_side) == expected.max_token_chars is not None


@given(st.lists(st.sampled_from(_PIECES), max_size=120), st.booleans())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_bounded_tokenization_gives_the_ids_of_the_whole_text(
    tiny: Path, llama3_like, monkeypatch: pytest.MonkeyPatch, parts: list[str], special: bool
) -> None:
    import glowplug.engine.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 8)  # many pieces, many boundaries
    text = "".join(parts)
    for tok in (load_tokenizer(tiny), llama3_like):
        assert tok.encode_bounded(text, limit=10**9, add_special_tokens=special) == tok.encode(
            text, add_special_tokens=special
        )


def test_a_prompt_too_long_is_refused_before_it_is_tokenized(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from glowplug.engine.tokenizer import PromptTooLong

    tok = load_tokenizer(tiny)
    longest = tok.shape.max_token_chars
    assert longest is not None

    def never(_texts: list[str]) -> list[object]:
        raise AssertionError("tokenized a prompt its length already proved too long")

    monkeypatch.setattr(tok, "_encode_nogil", never)
    with pytest.raises(PromptTooLong) as info:
        tok.encode_bounded("x" * (longest * 100 + 1), limit=100)
    assert info.value.at_least == 101 and "characters" in info.value.basis


def test_a_long_prompt_stops_being_tokenized_past_the_limit(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import glowplug.engine.tokenizer as tokenizer_module
    from glowplug.engine.tokenizer import PromptTooLong

    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 64)
    tok = load_tokenizer(tiny)
    calls: list[int] = []
    real = tok._encode_nogil
    monkeypatch.setattr(tok, "_encode_nogil", lambda texts: (calls.append(len(texts[0])), real(texts))[1])
    text = "hello world " * 1000  # well under the characters bound for 1,000 tokens, far over 200 tokens
    with pytest.raises(PromptTooLong) as info:
        tok.encode_bounded(text, limit=200)
    assert info.value.at_least > 200 and sum(calls) < len(text) / 4
    assert tok.encode_bounded("hello world", limit=200) == tok.encode("hello world")


def test_bounded_tokenization_leaves_the_gil_to_other_threads(tiny: Path) -> None:
    import threading
    import time

    tok = load_tokenizer(tiny)
    text = "the quick brown fox jumps over the lazy dog " * 40_000  # 1.8 MB

    def worst_lateness(work: Callable[[], object]) -> float:
        late: list[float] = []
        stop = threading.Event()

        def ticker() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                time.sleep(0.005)
                late.append(time.perf_counter() - t - 0.005)

        thread = threading.Thread(target=ticker)
        thread.start()
        try:
            work()
        finally:
            stop.set()
            thread.join()
        return max(late)

    whole = worst_lateness(lambda: tok.encode(text))
    bounded = worst_lateness(lambda: tok.encode_bounded(text, limit=10**9))
    # `encode` holds the GIL for all of it; the pieces release it while Rust works.
    assert bounded < whole / 3, (bounded, whole)


@pytest.mark.slow
def test_bounded_tokenization_is_exact_on_smollm2(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    import glowplug.engine.tokenizer as tokenizer_module

    tok = load_tokenizer(smollm2_dir)
    assert tok.shape.split_exact and tok.shape.max_token_chars == 81
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 16)
    rnd = random.Random(0)
    for _ in range(2000):
        text = "".join(rnd.choice(_PIECES) for _ in range(rnd.randint(0, 150)))
        assert tok.encode_bounded(text, limit=10**9) == tok.encode(text), text


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace pre-tokenizer and decoder, byte fallback), trained here: its
    decoder drops the space at the start of a decode, the case a cached continuation must not get wrong."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", *bytes_], show_progress=False)
    tok.train_from_iterator([t * 20 for t in TEXTS] + ["the quick brown fox jumps over the lazy dog " * 30], trainer)
    return tok


_SHARED: dict[object, Any] = {}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    texts=st.lists(st.text(max_size=40), min_size=1, max_size=4),
    which=st.sampled_from(["tiny", "metaspace"]),
    skip=st.booleans(),
)
def test_incremental_text_equals_one_decode_with_a_shared_cache(
    tiny: Path, texts: list[str], which: str, skip: bool
) -> None:
    """Every sequence's streamed text is the tokenizer's own decode of its tokens, while one DecodeCache (the
    learned single-token texts and continuations) is shared across all of them, as the engine shares it."""
    from glowplug.engine.detokenizer import DecodeCache

    if which not in _SHARED:
        _SHARED[which] = load_tokenizer(tiny) if which == "tiny" else _metaspace_tokenizer()
    if (which, skip) not in _SHARED:  # one cache per tokenizer and skip_special_tokens, as the engine keeps them
        _SHARED[(which, skip)] = DecodeCache(skip)
    tok, cache = _SHARED[which], _SHARED[(which, skip)]
    encode = (lambda t: tok(t)["input_ids"]) if which == "tiny" else (lambda t: tok.encode(t).ids)
    decode = tok.decode_list if which == "tiny" else tok.decode
    prompt = encode("Hello there")
    for text in texts:
        ids = encode(text + " and " + text)
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, cache=cache)
        streamed = ""
        for i in ids:
            detok.append(i)
            streamed += detok.take_stream_delta(False)
        detok.flush()
        streamed += detok.take_stream_delta(True)
        # The oracle: decode the prompt and the output together, and take what the output added.
        whole, head = decode(prompt + ids, skip), decode(prompt, skip)
        assert whole.startswith(head)
        assert detok.output_text == streamed == whole[len(head) :]


def test_a_cache_learned_under_the_other_skip_setting_is_refused() -> None:
    """The metaspace tokenizer's byte tokens are special: with skip_special_tokens they decode to nothing, without
    it to their byte. A cache learned one way would stream the other way's text, so it is refused by name."""
    from glowplug.engine.detokenizer import DecodeCache

    tok = _metaspace_tokenizer()
    byte = tok.token_to_id("<0x01>")
    assert tok.decode([byte], skip_special_tokens=True) != tok.decode([byte], skip_special_tokens=False)
    with pytest.raises(ValueError, match="skip_special_tokens=False.*keep one cache per setting"):
        IncrementalDetokenizer(tok, [], skip_special_tokens=True, cache=DecodeCache(False))
