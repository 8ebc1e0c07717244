"""The light tokenizer (tokenizers + jinja2) on Hugging Face folders, against transformers' AutoTokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from glowplug.engine.detokenizer import IncrementalDetokenizer
from glowplug.engine.models.arch import ModelError
from glowplug.engine.tokenizer import encode_chat, load_tokenizer

TEXTS = ["glowplug starts an inference server.", "Ünïcödé 🚀🔥 你好世界", "  two  spaces\n\ttab",
         "<|im_start|>user\nhi<|im_end|>", "", "Numbers 0 1 2 3 10 100"]  # fmt: skip
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
     {"role": "user", "content": "Ünïcödé 🚀"}],
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
    assert encode_chat(ours, messages) == ref(ref.apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True),
                                              add_special_tokens=False)["input_ids"]  # fmt: skip


def _with_config_template(tiny: Path, dest: Path, template: str) -> Path:
    """A copy whose chat template lives in tokenizer_config.json only (how older checkpoints ship it)."""
    shutil.copytree(tiny, dest)
    (dest / "chat_template.jinja").unlink()
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize("messages", [*CONVERSATIONS, [{"role": "skip", "content": "x"}, {"role": "user", "content": "y"}]])
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
